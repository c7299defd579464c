"""The parity audit's recompute (trainer/offload/audit.py: torch.optim over the shard's kernel runs)
equals the daemon's optimizer (ps_daemon/model/optimizer.py) bit for bit at any shard cut, and its
comparison counts what differs. No daemon: the daemon's ShardOptimizer runs here."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from ps_offload.daemon.model.optimizer import ShardOptimizer, state_tensors
from ps_offload.optimizers import GroupSettings
from ps_offload.optimizers import fused as fused_module
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import KernelRun, layout_params, plan_shards, segments_of
from ps_offload.trainer import SGD, AdamW
from ps_offload.trainer.offload.audit import difference, recompute

# Odd sizes (1, 7, 13, 91, 333, 4329, 2331 elements), so every shard size below cuts
# parameters off the kernels' 8-element blocks.
SHAPES = [("fc1.w", (13, 7)), ("fc1.b", (13,)), ("gain", (1,)), ("fc2.w", (333, 13)), ("fc2.b", (333,)),
          ("fc3.w", (7, 333)), ("fc3.b", (7,))]  # fmt: skip
GROUP_OF = [0 if len(shape) > 1 else 1 for _, shape in SHAPES]  # biases and the gain: no weight decay
STEPS = 4


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _settings(kind: str, step: int) -> list[dict]:
    """Each group's settings at `step` (an LR schedule moves them)."""
    lr = 3e-3 / (1 + step)
    if kind == "adamw":
        return [dict(lr=lr, weight_decay=wd, beta1=0.9, beta2=0.95, eps=1e-8) for wd in (0.1, 0.0)]
    momentum = 0.9 if kind == "sgd-momentum" else 0.0
    return [dict(lr=lr * 10, weight_decay=wd, momentum=momentum, dampening=0.0) for wd in (1e-4, 0.0)]


def _run(kind: str, shard_numel: int, *, naive: bool = False) -> list[tuple[int, int, str]]:
    """Steps every shard with the daemon's optimizer and, from the same state, with the
    audit's recompute; returns (step, shard, tensor) of every difference. `naive`: the
    recompute alone steps each parameter piece as one tensor, ignoring the kernel runs (the
    daemon's step must not see that: uncalibrated, it steps over the same kernel runs)."""
    layouts = layout_params([(name, shape, None) for name, shape in SHAPES])
    total = sum(layout.numel for layout in layouts)
    if kind == "adamw":
        config, optimizer = AdamW(), AdamW()
    else:
        momentum = 0.9 if kind == "sgd-momentum" else 0.0
        config = SGD(momentum=momentum, nesterov=bool(momentum))
        optimizer = SGD(momentum=momentum, nesterov=bool(momentum))
    g = torch.Generator().manual_seed(3)
    master = torch.randn(total, generator=g)
    daemons = []
    for shard in plan_shards(total, shard_numel, 1):
        segments = segments_of(shard, layouts)
        daemon = ShardOptimizer(
            config, segments, [0.0] * len(segments), [GROUP_OF[s.param_index] for s in segments], group_count=2
        )
        daemon.bind([torch.zeros(shard.numel) for _ in range(state_tensors(config))])
        daemons.append((shard, daemon))
    differences = []
    for step in range(STEPS):
        # Gradients over several orders of magnitude, so the two loops' roundings show.
        grad = torch.randn(total, generator=g) * 10.0 ** torch.randint(-3, 2, (total,), generator=g)
        settings = _settings(kind, step)
        for shard, daemon in daemons:
            piece = master[shard.offset : shard.end]
            before = [piece.clone(), *(s.clone() for s in daemon.state)]
            daemon.apply(piece, grad[shard.offset : shard.end], 0.0, [GroupSettings(**s) for s in settings])
            with _naive_runs() if naive else contextlib.nullcontext():
                expected = recompute(
                    optimizer, shard, layouts, GROUP_OF, before, grad[shard.offset : shard.end].clone(), step,
                    [ps_pb2.GroupHyperparams(**s) for s in settings],
                )  # fmt: skip
            for name, got, want in zip(("master", "state0", "state1"), [piece, *daemon.state], expected, strict=False):
                if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                    differences.append((step, shard.shard_id, name))
    return differences


@pytest.mark.parametrize("kind", ["adamw", "sgd-momentum", "sgd"])
@pytest.mark.parametrize("shard_numel", [37, 100, 1000, 1024, 3072, 7105])
def test_recompute_equals_the_daemons_optimizer_at_any_cut(kind, shard_numel):
    assert _run(kind, shard_numel) == []


@contextlib.contextmanager
def _naive_runs():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_module, "kernel_runs", lambda segment: [KernelRun(segment.shard_start, segment.numel)])
        yield


def test_a_recompute_that_ignores_the_kernel_runs_differs():
    """What the audit would report if it stepped each parameter piece as its own tensor."""
    assert _run("adamw", 1000, naive=True) != []


def test_difference_counts_bits_or_what_exceeds_the_tolerance():
    want = torch.tensor([1.0, 2.0, 0.0, math.nan, 5.0])
    got = want.clone()
    assert difference(got, want, 0.0) == (0.0, 0, -1)  # NaN against the same NaN: equal bits
    got[1] = math.nextafter(2.0, 3.0)  # one fp64 ulp rounds back to 2.0 in fp32: equal
    got[4] = torch.nextafter(torch.tensor(5.0), torch.tensor(6.0))
    got[2] = -0.0  # other bits, same value
    worst, count, first = difference(got, want, 0.0)
    assert (count, first) == (2, 2) and worst == pytest.approx(2**-21)
    assert difference(got, want, 1e-6) == (0.0, 0, -1)  # within the tolerance
    got[0] = math.nan
    worst, count, first = difference(got, want, 1e-6)
    assert (count, first) == (1, 0) and math.isnan(worst)
