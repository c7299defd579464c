"""Parity audit: now and then, one shard's update recomputed in process by torch.optim.

    opt = ps_offload.offload(model, ..., config=ps_offload.OffloadConfig(audit_every=1000))
    opt.audit.stats        # AuditStats(audited=..., skipped=..., mismatches=..., per_shard={...})

The daemons promise torch.optim.AdamW(fused=True) (and SGD(fused=True)) bit for bit. Every
`audit_every` steps this checks the promise on the real run: one shard, in turn through the
shards this process pushes, is pulled before its push (master, and the optimizer state:
exp_avg and exp_avg_sq, or SGD's momentum buffer, which the daemon serves as EXP_AVG) at the
step's version, the step happens, and its committed state is pulled at the next version. In
between, torch's own optimizer steps a copy of the pre-step state with the gradient the push
carried (the compute dtype widened to fp32, times the step's fp32 grad multiplier when
clipping or loss scaling set one, as the daemon takes it) and the settings of each param
group the step sent. A difference beyond `audit_tolerance` (none, by default) raises
AuditMismatch.

[Note: where the elements go] torch's fused CPU kernels round an element differently in
their SIMD body and in their scalar tail, and the daemon steps each parameter piece of a
shard as `kernel_runs` (ps_proto/plan.py, the shared contract) places it: whole blocks of
the parameter in place, a partial block at either end in a scratch tensor as long as that
block. The recompute builds its tensors from the same runs (each one a parameter of
torch.optim, in the param group of the parameter it is a piece of), so every element lands in
the loop it lands in on the daemon and in torch.optim's call on the whole parameter. The
math is torch.optim's public optimizer, not the daemon's code.

[Note: cost] One shard per audit, pulled into CPU fp32 scratch: three pulls before the step
(synchronously, so they complete before the shard's push leaves) and three after (AdamW;
two for SGD with momentum), and one optimizer step over that shard. An audit whose pulls
find another version than the step's (another process stepped the shard first) is counted
as skipped, not failed.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from ps_offload.optimizers import plugin_of
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ParamLayout, ShardSlice
from ps_offload.trainer.config import CompressionConfig, OffloadConfig, OptimizerConfig
from ps_offload.trainer.wire.sharded_client import ShardedClient

log = logging.getLogger(__name__)


class AuditMismatch(RuntimeError):
    """The daemon committed another update than torch.optim computes in process from the same
    state, gradient and settings. The step did happen on the daemons (the optimizer's step
    count moved); the message names model, shard, step, tensor, the largest difference and
    how many elements differ."""

    def __init__(
        self,
        *,
        model: str,
        shard_id: int,
        step: int,
        tensor: str,
        max_difference: float,
        differing: int,
        numel: int,
        detail: str,
        what: str = "",
    ) -> None:
        """`what`: the two sides compared, when not the daemon's commit and torch.optim's
        update (a replica against another, the trainer's values against the daemon's)."""
        self.model = model
        self.shard_id = shard_id
        self.step = step
        self.tensor = tensor
        self.max_difference = max_difference
        self.differing = differing
        what = what or f"the daemon's {tensor} differs from torch.optim's in-process update"
        super().__init__(
            f"parity audit of model {model!r}, shard {shard_id}, step {step}: {what} in {differing} of {numel} "
            f"elements, max |difference| {max_difference:.6g}; {detail}"
        )


@dataclass
class AuditStats:
    """What the audits of one optimizer found so far."""

    audited: int = 0
    """Audits compared (passed or not)."""
    skipped: int = 0
    """Audits not compared: a pull found another version than the step's."""
    mismatches: int = 0
    """Audits that found a difference (each raised AuditMismatch)."""
    per_shard: dict[int, int] = field(default_factory=dict)
    """Audits compared, by shard id."""
    seconds: float = 0.0
    """Time spent in the audits (pulls and recompute), for the overhead."""


@dataclass
class _Audit:
    """One audit under way: its shard and step, the pre-step state, and what the push carries."""

    shard: ShardSlice
    step: int
    before: list[torch.Tensor]  # master, then each state tensor; fp32 on the CPU
    grad: torch.Tensor  # the gradient as the daemon applies it: fp32, multiplied
    groups: list[ps_pb2.GroupHyperparams]
    seconds: float


def check_auditable(config: OffloadConfig, compression: CompressionConfig, optimizer: OptimizerConfig) -> None:
    """Refuses what the audit cannot recompute (with audit_every > 0): a compressed push (the
    daemon applies the decompressed payload with the trainer's error feedback, 1-bit Adam
    its momentum), factored optimizer state (Adafactor: no value per element to compare), and
    the delayed update (OffloadConfig refuses staleness=1 itself)."""
    plugin = plugin_of(optimizer)
    if config.audit_every and not plugin.per_element_state:
        raise ValueError(
            f"OffloadConfig.audit_every compares the optimizer state element by element: not with {plugin.name}, "
            "whose state is factored; use audit_every=0"
        )
    if config.audit_every and compression.method != "none":
        raise ValueError(
            f"OffloadConfig.audit_every recomputes the update from the gradient as it is: not with "
            f'CompressionConfig(method={compression.method!r}); use method="none" or audit_every=0'
        )


class ParityAudit:
    """The audits of one OffloadOptimizer (trainer/offload/whole_model.py): step() calls `before_push`
    before its pushes and `after_step` once they were acknowledged."""

    def __init__(self, opt: object, config: OffloadConfig) -> None:
        """`opt`: the OffloadOptimizer, built up to its attach (plan, flat buffers, io, groups)."""
        self.every = config.audit_every
        self.tolerance = config.audit_tolerance
        self.stats = AuditStats()
        self.client: ShardedClient = opt.client
        self.values = lambda: opt.flat.values  # the compute copy (replaced when the model moves)
        self.optimizer: OptimizerConfig = opt.optimizer
        self.state_dtype: torch.dtype = getattr(torch, config.state_dtype)  # (float32 or bfloat16)
        self.layouts: list[ParamLayout] = opt.flat.layouts
        position = {id(p): i for i, p in enumerate(opt.flat.params)}
        self.group_of = [0] * len(opt.flat.params)
        for index, group in enumerate(opt.param_groups):
            for p in group["params"]:
                self.group_of[position[id(p)]] = index
        self.shards = [s for s in opt.plan if s.shard_id in opt.io.pushes]
        self.tensors = _tensors(self.optimizer)
        self._turn = 0
        if self.every:
            log.info(
                "parity audit of model %r every %d steps over its %d shards, tolerance %g",
                self.client.model, self.every, len(self.shards), self.tolerance,
            )  # fmt: skip

    def before_push(
        self, step: int, groups: list[ps_pb2.GroupHyperparams], multiplier: float | None, grads: torch.Tensor
    ) -> _Audit | None:
        """On an audited step: pulls the next shard's pre-step state (it must be at version
        `step`) and keeps its slice of `grads` (the flat gradient buffer the step pushes), as
        the daemon applies it. None on other steps."""
        if not self.every or step % self.every or not self.shards:
            return None
        started = time.perf_counter()
        shard = self.shards[self._turn % len(self.shards)]
        self._turn += 1
        replicas = self._pull(shard, step)
        if replicas is None:
            self._skipped(shard, step, "before the push", started)
            return None
        before = self._agreed(shard, step, replicas)
        self._check_compute_copy(shard, step, before[0])
        grad = grads[shard.offset : shard.end].to("cpu", torch.float32, copy=True)  # exact widening
        if multiplier is not None:  # as the daemon applies it (ps_offload.daemon.store.push.multiplied)
            torch.mul(grad, torch.tensor(multiplier, dtype=torch.float32), out=grad)
        return _Audit(shard, step, before, grad, list(groups), time.perf_counter() - started)

    def after_step(self, audit: _Audit | None) -> None:
        """Pulls the committed state at version step + 1, recomputes and compares; raises
        AuditMismatch on a difference beyond the tolerance."""
        if audit is None:
            return
        started = time.perf_counter() - audit.seconds
        shard, step = audit.shard, audit.step
        replicas = self._pull(shard, step + 1)
        if replicas is None:
            self._skipped(shard, step, "after the step", started)
            return
        expected = recompute(
            self.optimizer, shard, self.layouts, self.group_of, audit.before, audit.grad, step, audit.groups,
            self.state_dtype,
        )  # fmt: skip
        self.stats.audited += 1
        self.stats.per_shard[shard.shard_id] = self.stats.per_shard.get(shard.shard_id, 0) + 1
        self.stats.seconds += time.perf_counter() - started
        for holder, after in replicas.items():  # every replica commits torch's update
            self._compare(shard, step, after, expected, self.tolerance, holder=holder)
        log.debug("parity audit of model %r shard %d step %d: equal", self.client.model, shard.shard_id, step)

    def _compare(
        self,
        shard: ShardSlice,
        step: int,
        got: list[torch.Tensor],
        want: list[torch.Tensor],
        tolerance: float,
        *,
        holder: int,
        against: int | None = None,
    ) -> None:
        """Raises AuditMismatch where `got` (holder `holder`'s tensors) differs from `want`
        (torch's update, or holder `against`'s tensors) beyond `tolerance`."""
        found = [(name, *difference(g, w, tolerance)) for name, g, w in zip(self.tensors, got, want, strict=True)]
        bad = [(name, worst, count, first) for name, worst, count, first in found if count]
        if not bad:
            return
        self.stats.mismatches += 1
        name, worst, count, first = bad[0]
        index = self.tensors.index(name)
        address = self.client.daemons[holder]
        if against is None:
            what = f"daemon {address}'s {name} differs from torch.optim's in-process update"
            detail = (
                f"first at {self._where(shard, first)}: daemon {got[index][first].item()!r}, torch "
                f"{want[index][first].item()!r}; {tolerance:g} allowed (OffloadConfig.audit_tolerance)"
            )
        else:
            other = self.client.daemons[against]
            what = f"the replicas' {name} before the step differ (daemon {address} against {other})"
            detail = (
                f"first at {self._where(shard, first)}: {got[index][first].item()!r} against "
                f"{want[index][first].item()!r}; the replicas have diverged: stop, and restore the model from a "
                "snapshot (ps-admin snapshot restore)"
            )
        if len(bad) > 1:
            detail += "; also " + ", ".join(f"{n} ({c} elements, max {w:.6g})" for n, w, c, _ in bad[1:])
        raise AuditMismatch(
            model=self.client.model, shard_id=shard.shard_id, step=step, tensor=name, max_difference=worst,
            differing=count, numel=shard.numel, detail=detail, what=what,
        )  # fmt: skip

    def _agreed(self, shard: ShardSlice, step: int, replicas: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
        """The pre-step state every live holder has, bit for bit (a replicated shard's copies
        must not differ: AuditMismatch naming the two holders)."""
        (first, state), *others = replicas.items()
        for holder, theirs in others:
            self._compare(shard, step, theirs, state, 0.0, holder=holder, against=first)
        return state

    def _check_compute_copy(self, shard: ShardSlice, step: int, master: torch.Tensor) -> None:
        """The trainer computed this step on the daemons' version `step`: its values of the
        shard are the master rounded to the compute dtype (as the daemon rounds a pull,
        `Tensor.to`); else AuditMismatch (a pull that never landed, or values changed in place
        behind the optimizer's back)."""
        values = self.values()[shard.offset : shard.end].to("cpu")
        expected = master.to(values.dtype)
        differs = values.view(-1) != expected
        differs &= ~(values.isnan() & expected.isnan())
        count = int(differs.sum())
        if not count:
            return
        self.stats.mismatches += 1
        first = int(differs.nonzero()[0])
        gap = (values.float()[differs] - expected.float()[differs]).abs()
        raise AuditMismatch(
            model=self.client.model, shard_id=shard.shard_id, step=step, tensor="master",
            max_difference=float(gap.max()), differing=count, numel=shard.numel,
            what="the trainer's parameters differ from the daemons' master values they were pulled from",
            detail=(
                f"first at {self._where(shard, first)}: trainer {values[first].item()!r}, daemon (rounded to "
                f"{values.dtype}) {expected[first].item()!r}. The trainer computed this step on other values "
                "than the daemons hold: were the parameters changed in place after offload() (an init, a "
                "load_state_dict without assign)? Nothing of this step was pushed"
            ),
        )  # fmt: skip

    def _pull(self, shard: ShardSlice, version: int) -> dict[int, list[torch.Tensor]] | None:
        """Each live holder's master and state of the shard at exactly `version`, fp32 on the
        CPU (one holder unless the model is replicated); None if a pull found another version."""
        out: dict[int, list[torch.Tensor]] = {}
        for tensor in (ps_pb2.MASTER, ps_pb2.EXP_AVG, ps_pb2.EXP_AVG_SQ)[: len(self.tensors)]:
            for holder, (got, values) in self.client.pull_each(shard, min_version=version, tensor=tensor).items():
                if got != version:
                    return None
                out.setdefault(holder, []).append(values)
        lengths = {len(tensors) for tensors in out.values()}
        if lengths != {len(self.tensors)}:  # a holder lost between two of the pulls: audit the others
            out = {holder: tensors for holder, tensors in out.items() if len(tensors) == len(self.tensors)}
        return out or None

    def _skipped(self, shard: ShardSlice, step: int, when: str, started: float) -> None:
        self.stats.skipped += 1
        self.stats.seconds += time.perf_counter() - started
        log.info(
            "parity audit of model %r shard %d step %d skipped: the shard was at another version %s "
            "(another process stepped it)", self.client.model, shard.shard_id, step, when,
        )  # fmt: skip

    def _where(self, shard: ShardSlice, element: int) -> str:
        flat = shard.offset + element
        for layout in self.layouts:
            if layout.offset <= flat < layout.offset + layout.numel:
                return f"shard element {element} ({layout.name}.view(-1)[{flat - layout.offset}])"
        return f"shard element {element}"


def _tensors(optimizer: OptimizerConfig) -> tuple[str, ...]:
    """The shard tensors an audit compares, in pull order (proto ShardTensor: the state by position)."""
    return ("master", *plugin_of(optimizer).state_names(optimizer))


def recompute(
    optimizer: OptimizerConfig,
    shard: ShardSlice,
    layouts: list[ParamLayout],
    group_of: list[int],
    before: list[torch.Tensor],
    grad: torch.Tensor,
    step: int,
    groups: list[ps_pb2.GroupHyperparams],
    state_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """The shard's master and state after one step of the optimizer's reference from `before`
    (master, then the state tensors; the daemon's step count is `step`, its version) with the
    fp32 gradient `grad` and each param group's `groups[g]` (OptimizerPlugin.recompute: for
    AdamW and SGD torch.optim itself over the shard's kernel runs, the note on placement above).
    `state_dtype` bfloat16 (OffloadConfig.state_dtype): torch steps bf16 tensors (`before` and
    the result are their exact fp32 widening, and `grad` is rounded to bf16 first, as the
    daemon does)."""
    return plugin_of(optimizer).recompute(optimizer, shard, layouts, group_of, before, grad, step, groups, state_dtype)


def difference(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> tuple[float, int, int]:
    """(max |got - want| over the elements that differ, how many differ, the first one's
    index); (0.0, 0, -1) when none does. An element differs when its bits do and, with a
    tolerance, when it is further than that (a NaN against anything else always differs)."""
    differs = got.view(torch.int32) != want.view(torch.int32)
    if tolerance:
        differs &= ~((got - want).abs() <= tolerance) & ~(got.isnan() & want.isnan())
    count = int(differs.sum())
    if not count:
        return 0.0, 0, -1
    gap = (got[differs] - want[differs]).abs()
    worst = math.nan if bool(gap.isnan().any()) else float(gap.max())
    return worst, count, int(differs.nonzero()[0])
