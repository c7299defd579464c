"""trainer/pipeline/compressed_allreduce.py over real gloo groups of 2 and 3 processes: every rank ends
with the same bucket; the result is the algorithm spelled out in one process; error feedback
makes the average over rounds converge to the true sum; PipelineTrainer's warm-up steps are
plain all-reduces."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ps_offload import kernels
from ps_offload.trainer.config import AdamW, CompressionConfig, ParallelConfig
from ps_offload.trainer.pipeline.compressed_allreduce import CompressedAllReduce
from ps_offload.trainer.pipeline.grid import RankGrid
from ps_offload.trainer.pipeline.trainer import PipelineTrainer

SIZES = (1, 13, 1000, 3000, 4099)  # below one block, not a multiple of 8 or of BLOCK, W > chunks
ROUNDS = 40
METHODS = {"onebit": {}, "bf16": {}, "topk": {"topk_ratio": 0.1}}


def _gradient(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * n + rank)
    return torch.randn(n, generator=g) + 0.3 * (rank + 1)  # ranks disagree in sign here and there


def _join(rank: int, world: int, rendezvous: str) -> None:
    torch.set_num_threads(1)  # as torchrun does: the processes share this machine's cores
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def _buckets_ranks(rank: int, world: int, rendezvous: str, out: str) -> None:
    """Every method, with the dispatched kernels (overlapped, ROUNDS rounds) and with the
    torch reference (inline, 2 rounds), on several buckets of one flat buffer."""
    _join(rank, world, rendezvous)
    flat = torch.zeros(sum(SIZES))
    offsets = [sum(SIZES[:i]) for i in range(len(SIZES))]
    views = [flat[o : o + n] for o, n in zip(offsets, SIZES, strict=True)]
    results = {}
    for method, options in METHODS.items():
        for backend, rounds in ((None, ROUNDS), ("torch", 2)):
            hook = CompressedAllReduce(method, **options, backend=backend, overlap=backend is None)
            seen = []
            for _ in range(rounds):
                for view, n in zip(views, SIZES, strict=True):
                    view.copy_(_gradient(rank, n))
                handles = [hook(view, dist.group.WORLD) for view in views]
                for handle in handles:
                    if handle is not None:
                        handle.wait()
                seen.append(flat.clone())
            hook.close()
            results[method, backend] = torch.stack(seen)
    hook = CompressedAllReduce("onebit")
    hook.enabled = False  # the warm-up: a plain all-reduce
    for view, n in zip(views, SIZES, strict=True):
        view.copy_(_gradient(rank, n))
        hook(view, dist.group.WORLD).wait()
    results["plain"] = flat.clone()
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory):
    """What each of `world` processes saw: {(method, backend): [rounds, sum(SIZES)], "plain": ...}."""
    world = request.param
    tmp = tmp_path_factory.mktemp(f"world{world}")
    mp.spawn(_buckets_ranks, args=(world, str(tmp / "rendezvous"), str(tmp)), nprocs=world)
    return world, [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


def _parts(flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat.split(SIZES, dim=-1))


def _spelled_out(method: str, world: int, n: int, rounds: int) -> list[torch.Tensor]:
    """The algorithm in one process with the reference kernels: chunks of whole blocks,
    compressed by every worker with its error, summed by the chunk's owner, compressed again
    with the owner's error."""

    def round_trip(values: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
        if method == "onebit":
            bits, scales = kernels.onebit_compress(values, error, backend="torch")
            return kernels.onebit_decompress(bits, scales, values.numel(), backend="torch")
        if method == "bf16":
            return kernels.cast_decompress(kernels.cast_compress(values, error, dtype=torch.bfloat16, backend="torch"),
                                           backend="torch")  # fmt: skip
        indices, kept = kernels.topk_compress(values, error, 0.1, backend="torch")
        return kernels.topk_decompress(indices, kept, values.numel(), backend="torch")

    chunk = math.ceil(n / (world * kernels.BLOCK)) * kernels.BLOCK
    parts = [slice(w * chunk, min(n, (w + 1) * chunk)) for w in range(world) if w * chunk < n]
    worker_errors = [torch.zeros(n) for _ in range(world)]
    server_errors = [torch.zeros(p.stop - p.start) for p in parts]
    out = []
    for _ in range(rounds):
        result = torch.empty(n)
        for part, server_error in zip(parts, server_errors, strict=True):
            total = sum(round_trip(_gradient(w, n)[part], worker_errors[w][part]) for w in range(world))
            result[part] = round_trip(total, server_error)
        out.append(result)
    return out


@pytest.mark.slow
def test_every_rank_ends_with_the_same_bucket_every_round(ranks):
    world, seen = ranks
    for key in seen[0]:
        for rank in range(1, world):
            assert torch.equal(seen[rank][key], seen[0][key]), (key, rank)


@pytest.mark.slow
def test_the_result_is_the_algorithm_spelled_out_in_one_process(ranks):
    world, seen = ranks
    for method in METHODS:
        got = seen[0][method, "torch"]
        for i, n in enumerate(SIZES):
            expected = _spelled_out(method, world, n, rounds=2)
            for r in range(2):
                torch.testing.assert_close(_parts(got[r])[i], expected[r], rtol=1e-6, atol=1e-6, msg=(method, n, r))


@pytest.mark.slow
def test_error_feedback_makes_the_average_converge_to_the_true_sum(ranks):
    """The same gradients every round: without error feedback every round would be as far
    off as the first; with it the errors carry what was lost into the next rounds, so the
    average keeps approaching the true sum. (Under the 1-bit codec's mean-|c| block scale
    the error buffers grow like sqrt(rounds) on a constant gradient, so the average's
    error falls like 1/sqrt(rounds), not 1/rounds as under bf16.)"""
    world, seen = ranks
    # method: (a first round at least this far off, the average after ROUNDS at most this
    # far, and at most this fraction of the average's after 10 rounds)
    for method, (first_off, average_within, shrink) in {
        "onebit": (0.3, 0.2, 0.6), "topk": (0.3, 0.2, 0.6), "bf16": (1e-3, 2e-4, 1.0)
    }.items():  # fmt: skip
        rounds = seen[0][method, None]
        for i, n in enumerate(SIZES):
            true = sum(_gradient(r, n) for r in range(world))

            def error(average: torch.Tensor, i=i, true=true) -> float:
                return float((_parts(average)[i] - true).norm() / true.norm())

            first, early, late = error(rounds[0]), error(rounds[:10].mean(0)), error(rounds.mean(0))
            assert late <= average_within and late <= shrink * early or late <= 1e-6, (method, n, first, early, late)
            if n >= 1000:  # a round alone is far off (a lone element compresses exactly)
                assert first >= first_off, (method, n, first)


@pytest.mark.slow
def test_disabled_it_is_the_plain_all_reduce(ranks):
    world, seen = ranks
    true = torch.cat([sum(_gradient(r, n) for r in range(world)) for n in SIZES])
    torch.testing.assert_close(seen[0]["plain"], true)


def _trainer_ranks(rank: int, world: int, rendezvous: str, out: str) -> None:
    """pp=1 x dp=2 on a small MLP: plain and onebit with two warm-up steps, side by side."""
    _join(rank, world, rendezvous)
    ctx = types.SimpleNamespace(
        grid=RankGrid(1, world, rank), pp_group=dist.new_group([rank], use_local_synchronization=True),
        dp_group=dist.group.WORLD, device=torch.device("cpu"),
    )  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)) for _ in range(4)]
    params = {}
    for compression in ("none", "onebit"):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)]
        dp = CompressionConfig(method="onebit", warmup_steps=2) if compression == "onebit" else CompressionConfig()
        model = PipelineTrainer(
            layers, torch.nn.functional.cross_entropy, ctx=ctx, optimizer=AdamW(lr=1e-2),
            config=ParallelConfig(microbatches=2, dp_compression=dp),
        )  # fmt: skip
        steps = []
        for x, y in data:
            model.step(x, y)
            steps.append(torch.cat([p.detach().flatten().clone() for p in model.module.parameters()]))
        model.close()
        params[compression] = torch.stack(steps)
    torch.save(params, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_pipeline_trainer_warms_up_uncompressed_then_compresses_identically_on_every_replica(tmp_path):
    mp.spawn(_trainer_ranks, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key in ("none", "onebit"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    plain, onebit = ranks[0]["none"], ranks[0]["onebit"]
    assert torch.equal(onebit[:2], plain[:2])  # the two warm-up steps: the plain all-reduce
    assert not torch.allclose(onebit[2:], plain[2:], rtol=0, atol=1e-6)  # then compressed


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match=r"must be one of \['bf16', 'fp16', 'onebit', 'topk'\], got 'int8'"):
        CompressedAllReduce("int8")
    for ratio in (0, 1.5):
        with pytest.raises(ValueError, match=r"topk_ratio must be in \(0, 1\]"):
            CompressedAllReduce("topk", topk_ratio=ratio)
    ctx = types.SimpleNamespace(grid=RankGrid(1, 1, 0))
    layers, loss = [torch.nn.Linear(2, 2)], torch.nn.functional.mse_loss
    bad = {
        "CompressionConfig.method must be one of": lambda: {"dp_compression": CompressionConfig(method="2bit")},
        "give reduce_hook or dp_compression='onebit', not both": lambda: {
            "dp_compression": CompressionConfig(method="onebit"), "reduce_hook": lambda bucket, group: None
        },
        "warmup_steps must be an int >= 0": lambda: {
            "dp_compression": CompressionConfig(method="onebit", warmup_steps=-1)
        },
        "it needs a dp_compression other than none": lambda: {"dp_compression": CompressionConfig(warmup_steps=3)},
        r"topk_ratio must be in \(0, 1\]": lambda: {
            "dp_compression": CompressionConfig(method="topk", topk_ratio=0.0)
        },
    }  # fmt: skip
    for message, options in bad.items():
        with pytest.raises(ValueError, match=message):
            given = options()
            hook = given.pop("reduce_hook", None)
            config = ParallelConfig(microbatches=1, **given)
            PipelineTrainer(layers, loss, ctx=ctx, optimizer=AdamW(), config=config, reduce_hook=hook)
