"""The pure parts of the pipeline trainer: the rank grid and the stage split
(trainer/pipeline/grid.py), the gradient buckets (trainer/pipeline/reducer.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ps_offload.trainer.io.flat import FlatParams
from ps_offload.trainer.pipeline.grid import RankGrid, split_layers
from ps_offload.trainer.pipeline.reducer import GradReducer


def test_grid_is_stage_major():
    cells = [(g.stage, g.replica) for g in (RankGrid(2, 3, r) for r in range(6))]
    assert cells == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert RankGrid(2, 3, 0).first_stage and RankGrid(2, 3, 5).last_stage
    with pytest.raises(ValueError, match="outside a grid"):
        RankGrid(2, 2, 4)


def test_split_by_params_minimises_the_largest_stage():
    sizes = [100, 0, 10, 10, 10, 0, 70]
    ranges = split_layers(sizes, 2)
    assert ranges == [(0, 1), (1, 7)]  # 100 | 90: the earliest of the equally good cuts
    ranges = split_layers(sizes, 3)
    assert max(sum(sizes[a:b]) for a, b in ranges) == 100
    assert [b - a >= 1 for a, b in ranges] == [True] * 3
    assert ranges[0][0] == 0 and ranges[-1][1] == len(sizes)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(2))


def test_split_uniform_and_bad_requests():
    assert split_layers([1] * 7, 3, by="uniform") == [(0, 2), (2, 5), (5, 7)]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        split_layers([1, 1], 3)
    with pytest.raises(ValueError, match='split must be "params" or "uniform"'):
        split_layers([1, 1], 2, by="memory")


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_buckets_form_from_the_end_with_a_small_first_one(single_process_group):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 1000, 1000, 300)]
    flat = FlatParams((f"p{i}", p) for i, p in enumerate(params))
    reducer = GradReducer(flat, single_process_group, microbatches=2, bucket_bytes=8000, first_bucket_bytes=1000)
    # Backward order: the 300-element parameter alone (1200 bytes >= 1000), then 8000 bytes each.
    assert [(lo, hi) for lo, hi, _ in reducer.buckets] == [(3000, 3300), (1000, 3000), (0, 1000)]
    reducer.close()


def test_a_bucket_starts_once_every_gradient_in_it_has_its_last_micro_batch(single_process_group):
    layer = torch.nn.Linear(4, 4)
    flat = FlatParams(layer.named_parameters())
    reducer = GradReducer(flat, single_process_group, microbatches=2, bucket_bytes=1 << 20)
    layer(torch.ones(1, 4)).sum().backward()
    assert reducer._works == {}  # one micro-batch of two: nothing complete yet
    layer(torch.ones(1, 4)).sum().backward()
    assert set(reducer._works) == set(range(len(reducer.buckets)))
    reducer.finish()
    # The sum of two micro-batches of ones, divided by dp (1) x micro-batches (2).
    assert torch.equal(layer.bias.grad, torch.ones(4)) and torch.equal(layer.weight.grad, torch.ones(4, 4))
    reducer.close()


def test_a_grid_that_does_not_match_torchruns_world_is_refused(monkeypatch):
    from ps_offload.trainer.pipeline.grid import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"pp x dp = 2 x 1 = 2, but torchrun started 4 processes"):
        init_distributed(2, 1)


def _single_rank_context(group: dist.ProcessGroup):
    from ps_offload.trainer.pipeline.grid import ParallelContext

    return ParallelContext(RankGrid(1, 1, 0), group, group, torch.device("cpu"))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"daemons": None}, "a streamed stage needs daemons"),
        ({"stream_micro_batches": 1}, r"Streaming\(micro_batches=1\) is for offload\(\)"),
        ({"config": {"max_grad_norm": 1.0}}, "does not support ParallelConfig.max_grad_norm yet"),
        ({"config": {"dp_compression": "onebit"}}, "does not support ParallelConfig.dp_compression yet"),
        ({"staleness": 1}, r"does not support OffloadConfig.staleness=1 yet"),
        ({"other_blocks": True}, "stage 0 .* holds none of Streaming.blocks"),
    ],
)  # fmt: skip
def test_a_streamed_stage_refuses_what_it_does_not_do_before_contacting_a_daemon(single_process_group, change, message):
    """Each refusal comes before any daemon is contacted (the address given accepts nothing)."""
    from ps_offload import trainer

    layers = [torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)]
    blocks = [torch.nn.Linear(4, 4)] if change.get("other_blocks") else [layers[0], layers[2]]
    compression = trainer.CompressionConfig(method=change.get("config", {}).get("dp_compression", "none"))
    config = trainer.ParallelConfig(
        microbatches=2, schedule="gpipe", max_grad_norm=change.get("config", {}).get("max_grad_norm"),
        dp_compression=compression,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        trainer.PipelineTrainer(
            layers, torch.nn.functional.mse_loss, ctx=_single_rank_context(single_process_group),
            optimizer=trainer.AdamW(lr=1e-3), config=config, daemons=change.get("daemons", ["127.0.0.1:1"]),
            offload=trainer.OffloadConfig(staleness=change.get("staleness", 0)),
            stream=trainer.Streaming(blocks=blocks, micro_batches=change.get("stream_micro_batches", 0)),
        )  # fmt: skip
