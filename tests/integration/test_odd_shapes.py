"""Bit-identical to torch.optim wherever the shard cuts fall inside parameters.

torch's fused CPU kernels (AdamW(fused=True), SGD(fused=True)) compute the last n % 8 elements
of each tensor in a scalar loop that rounds differently from their SIMD body. The plan packs
parameters end to end and cuts shards at page multiples of the flat space, so with odd parameter
sizes a cut lands at any offset inside a parameter; a piece stepped as its own tensor would put
a tail where the whole parameter has none (before the fix, this file measured up to 3e-8 off for
AdamW and 6e-6 for SGD in 30 steps). The daemon steps such pieces through ps_proto/plan.py's
kernel_runs. The model (tests/helpers/odd_shapes.py) has odd sizes (1, 7, 13, 91, 333, 4329,
2331 elements, Linear(7, 13) first), so every shard size below cuts parameters at offsets that
are not multiples of 8.

Any difference at all is a bug, hence torch.equal rather than a tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ps_offload import trainer
from ps_offload.daemon.model.optimizer import ShardOptimizer, state_tensors
from ps_offload.optimizers import SGD, AdamW
from ps_offload.proto.plan import layout_params, plan_shards, segments_of, shard_numel_for
from tests.helpers.odd_shapes import STEPS, odd_case, odd_cuts
from tests.helpers.training import no_decay, train_offloaded, train_reference


@pytest.fixture(autouse=True)
def threads(monkeypatch, request):
    """One torch thread here and in the daemons started by the test (OMP_NUM_THREADS is
    read at their start): on a loaded machine the kernels' OpenMP barriers on these tiny
    tensors cost 10x the work. The thread count cannot move a tail (the kernels split work
    in whole 16-element cache lines); test_shard_optimizer_matches_torch_fused_at_any_cut
    checks that with 2 threads too (`threads` parameter)."""
    count = getattr(request, "param", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    monkeypatch.setenv("OMP_NUM_THREADS", str(count))
    yield count
    torch.set_num_threads(before)


def _optimizers(kind: str, reference: nn.Module):
    """(torch.optim in-process on `reference`, the trainer's config for the daemons)."""
    if kind == "adamw":
        decay = [p for n, p in reference.named_parameters() if not no_decay(n, p)]
        undecayed = [p for n, p in reference.named_parameters() if no_decay(n, p)]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": undecayed, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=3e-3, fused=True), trainer.AdamW(lr=3e-3, weight_decay=0.1)
    torch_opt = torch.optim.SGD(
        reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True, fused=True
    )
    return torch_opt, trainer.SGD(lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)


def _assert_equal(model: nn.Module, reference: nn.Module, where: str) -> None:
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs), f"{where}, {name}: max |diff| {(ours - theirs).abs().max().item()}"


# 4, 8 and 12 KiB shards: cuts inside fc2.weight at 919, 1943, 2967, 3991 and inside
# fc3.weight at 353, 1377 (in elements), none a multiple of 8.
SHARD_BYTES = (4096, 8192, 12288)


@pytest.mark.parametrize("n_daemons", [1, 2])
def test_odd_shapes_through_daemons_match_torch_fused(n_daemons, daemon_factory):
    # Every case on the same daemons, one model name each: starting a daemon costs more than
    # training this model.
    daemons = daemon_factory.together([()] * n_daemons)
    for kind in ("adamw", "sgd"):
        for shard_bytes in SHARD_BYTES:
            model, batches, loss_fn = odd_case()
            assert odd_cuts(model, shard_numel_for(shard_bytes)), shard_bytes  # the case under test
            reference = copy.deepcopy(model)
            torch_opt, optimizer = _optimizers(kind, reference)
            train_reference(reference, batches, loss_fn, torch_opt)
            with trainer.offload(
                model,
                daemons=[d.address for d in daemons],
                optimizer=optimizer,
                no_weight_decay=no_decay if kind == "adamw" else None,
                config=trainer.OffloadConfig(model_name=f"odd-{kind}-{shard_bytes}", shard_bytes=shard_bytes),
            ) as opt:
                assert {s.daemon_index for s in opt.plan} == set(range(n_daemons))
                losses = train_offloaded(model, batches, loss_fn, opt)
            assert losses[-1] < losses[0]
            _assert_equal(model, reference, f"{kind}, {n_daemons} daemon(s), shard_bytes {shard_bytes}")


# -- the daemon's optimizer alone, at shard sizes the daemon never uses (any cut) ---------


def _shard_optimizer_run(kind: str, shard_numel: int, steps: int = STEPS) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Steps the odd model's parameters with torch.optim (in process) and, on the same
    gradients, with one ShardOptimizer per shard of `shard_numel` elements; returns the
    reference parameters and the shards' flat master values."""
    model, _, _ = odd_case(0)
    named = list(model.named_parameters())
    reference = [p.detach().clone().requires_grad_() for _, p in named]
    decays = [0.0 if no_decay(n, p) else (0.1 if kind == "adamw" else 1e-4) for n, p in named]
    groups = [{"params": [r], "weight_decay": d} for r, d in zip(reference, decays, strict=True)]
    if kind == "adamw":
        torch_opt = torch.optim.AdamW(groups, lr=3e-3, fused=True)
        config = AdamW(lr=3e-3)
    else:
        torch_opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, fused=True)
        config = SGD(lr=0.05, momentum=0.9)

    layouts = layout_params([(n, tuple(p.shape), d) for (n, p), d in zip(named, decays, strict=True)])
    flat = torch.cat([p.detach().reshape(-1) for _, p in named])
    shards = []
    for shard in plan_shards(flat.numel(), shard_numel, 1):
        segments = segments_of(shard, layouts)
        optimizer = ShardOptimizer(config, segments, [layouts[s.param_index].weight_decay for s in segments])
        optimizer.bind([torch.zeros(shard.numel) for _ in range(state_tensors(config))])
        shards.append((shard, optimizer))

    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        # Gradients over several orders of magnitude, so the two loops' roundings show.
        grads = [
            torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-3, 2, p.shape, generator=g) for p in reference
        ]
        for r, grad in zip(reference, grads, strict=True):
            r.grad = grad.clone()
        torch_opt.step()
        flat_grad = torch.cat([grad.reshape(-1) for grad in grads])
        for shard, optimizer in shards:
            optimizer.apply(flat[shard.offset : shard.end], flat_grad[shard.offset : shard.end].clone(), config.lr)
    return reference, flat


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize(
    ("shard_numel", "threads"),
    [(37, 1), (100, 1), (1000, 1), (1024, 1), (3072, 1), (3072, 2), (7105, 1)],
    indirect=["threads"],
)
def test_shard_optimizer_matches_torch_fused_at_any_cut(kind, shard_numel, threads):
    reference, flat = _shard_optimizer_run(kind, shard_numel)
    assert torch.equal(flat, torch.cat([r.detach().reshape(-1) for r in reference])), (
        f"{kind}, shard_numel {shard_numel}: max |diff| "
        f"{(flat - torch.cat([r.detach().reshape(-1) for r in reference])).abs().max().item()}"
    )
