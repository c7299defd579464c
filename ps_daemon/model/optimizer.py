"""Server-side optimizers over shards, equal to torch.optim.

Each step runs torch's fused CPU kernel (`torch._fused_adamw_`, `torch._fused_sgd_`, the
kernels behind `torch.optim.AdamW(fused=True)` and `SGD(fused=True)`) over each parameter
piece of the shard, never over the shard as one tensor. The kernel's SIMD body and scalar
tail round differently and it puts the tail at the end of each tensor it is given, so a
piece that a shard cut leaves inside a parameter is split into kernel runs
(ps_proto/plan.py, `kernel_runs`): whole aligned blocks in place, a partial block at either
end in a scratch tensor as long as that block. Same kernel, same loop per element, same
inputs: the daemon's parameters are bit-identical to an in-process torch.optim run on the
same gradients, wherever the cuts fall.

A GRADIENT push may carry the settings of every param group for its step (a torch LR
scheduler changes them between steps): each parameter's runs are then stepped with its own
group's lr, weight decay and betas, eps (AdamW) or momentum, dampening (SGD), one kernel call
per group as torch.optim.AdamW(param_groups, fused=True) makes one per group. Without them
the registered settings apply, with each parameter's weight decay and the push's lr.

A MOMENTUM push (1-bit Adam's compression stage, AdamW only) is applied by `apply_momentum`:
exp_avg becomes the trainer's momentum, exp_avg_sq stays frozen, and the master takes
AdamW's step. In ONEBIT encoding it runs kernels.fused_adamw.onebit_adam_, which reads the
signs and block scales and updates the master and exp_avg in one pass; any other encoding
arrives decompressed to fp32. Compressed GRADIENT pushes reach `apply` decompressed
(ShardStore.push), so they run the same fused torch kernels as RAW ones.

bf16 state (ModelSpec.state_dtype, AdamW only): master, m and v are bf16 tensors, stepped by
the same fused torch kernel on them as AdamW(fused=True) steps a bf16 model's own parameters
(it computes in fp32 and rounds each result to bf16). The gradient is what torch would hold in
`param.grad`: a bf16 gradient as it came; times grad_multiplier in fp32 and rounded back to
bf16, as GradScaler's unscale_ does in place; an fp32 one (decompressed, or sent wide) rounded
to bf16. Once calibrated, kernels/bf16_state_step.py steps it in one pass that also writes the
pull a push carries (torch's bf16 kernel is bound by its conversions on the daemon's cores).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from ps_offload.daemon.model import faults
from ps_offload.daemon.model.encodings import KERNEL_LOCK, OneBitGradient
from ps_offload.kernels import bf16_state_step, fused_step, step_calibration
from ps_offload.kernels.fused_adamw import adam_frozen_variance_, onebit_adam_
from ps_offload.proto.plan import KernelRun, Segment, kernel_runs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2

    state_per_param = 2  # m, v


@dataclass(frozen=True)
class SGDConfig:
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    @property
    def state_per_param(self) -> int:
        return 1 if self.momentum else 0


OptimizerConfig = AdamWConfig | SGDConfig


@dataclass(frozen=True)
class GroupHyperparams:
    """One param group's settings for one step (proto GroupHyperparams). AdamW reads lr,
    weight_decay, beta1, beta2 and eps; SGD reads lr, weight_decay, momentum and dampening."""

    lr: float
    weight_decay: float
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0


def log_calibration(found: Future) -> None:
    """Says which way the daemon steps, once the one-pass kernel's calibration is known."""
    if found.exception() is None and found.result() is not None:
        log.info("one-pass optimizer kernel calibrated against torch %s: %s", torch.__version__, found.result())
    else:
        log.warning(
            "the one-pass optimizer kernel does not compute as this torch build's fused AdamW and SGD: the daemon "
            "steps with torch's kernels (bit for bit as before, with a pass more over each gradient)"
        )


def _widened(grad: torch.Tensor, multiplier: float | None) -> torch.Tensor:
    """The fp32 gradient times `multiplier` (as torch.amp's unscale_: an fp32 product)."""
    wide = grad.float()
    if multiplier is not None:
        wide = torch.mul(wide, torch.tensor(multiplier, dtype=torch.float32))
    return wide


def _narrowed(grad: torch.Tensor, multiplier: float | None, dtype: torch.dtype) -> torch.Tensor:
    """The gradient a model of `dtype` parameters holds in `param.grad` (module docstring)."""
    if multiplier is not None:
        grad = torch.mul(grad.float(), torch.tensor(multiplier, dtype=torch.float32))
    return grad.to(dtype)


def _one_pass_tasks(segments: list[Segment], vector: int) -> np.ndarray:
    """The one-pass kernel's tasks for `segments`: each piece with where its parameter's
    scalar tail starts for torch's `vector`-wide body (kernels/fused_step.py)."""
    pieces = []
    for seg in segments:
        tail = seg.param_numel - seg.param_numel % vector  # the parameter's first tail element
        pieces.append((seg.shard_start, seg.shard_start + seg.numel, seg.shard_start + tail - seg.param_start))
    return fused_step.tasks(pieces)


def validate_optimizer(config: OptimizerConfig) -> None:
    """Raises ValueError with an actionable message for values torch.optim would refuse."""
    if not config.lr >= 0:
        raise ValueError(f"lr must be >= 0, got {config.lr}")
    if not config.weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {config.weight_decay}")
    if isinstance(config, AdamWConfig):
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(config, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(config, name)}")
        if not config.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {config.eps}")
    else:
        if not config.momentum >= 0:
            raise ValueError(f"momentum must be >= 0, got {config.momentum}")
        if config.nesterov and (config.momentum <= 0 or config.dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening 0")


class ShardOptimizer:
    """Optimizer state for one shard and the step that updates its master values.

    Invariant: `state` tensors have the shard's numel; `step` counts applied updates and
    equals the shard's version."""

    def __init__(
        self,
        config: OptimizerConfig,
        segments: list[Segment],
        weight_decays: list[float],
        groups: list[int] | None = None,
        *,
        group_count: int = 1,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        """Per segment: its parameter's weight decay (registered) and param group (an index
        below `group_count`, the model's number of groups; all 0 if None). `state_dtype`: the
        master's and the state's (fp32 or bf16: ModelSpec.state_dtype)."""
        self.config = config
        self.group_count = group_count
        self.state_dtype = state_dtype
        self.state: list[torch.Tensor] = []  # bound by the shard to its arena (bind())
        self.step = torch.zeros((), dtype=torch.float32)
        groups = [0] * len(segments) if groups is None else groups
        # Kernel runs by weight decay (registered settings) and by param group (a push's
        # settings): the fused kernels take one scalar of each per call.
        by_decay: dict[float, list[Segment]] = defaultdict(list)
        by_group: dict[int, list[Segment]] = defaultdict(list)
        for segment, decay, group in zip(segments, weight_decays, groups, strict=True):
            by_decay[decay].append(segment)
            by_group[group].append(segment)
        self._segments_by_decay = dict(by_decay)
        self._segments_by_group = dict(by_group)
        self._tasks: dict[tuple[str, float], np.ndarray] = {}  # the one-pass kernel's, by call (_call_tasks)
        # The same pieces in shard order, for the 1-bit Adam update: (start, end, decay).
        self._pieces = sorted(
            (s.shard_start, s.shard_start + s.numel, d) for s, d in zip(segments, weight_decays, strict=True)
        )

    def bind(self, state: list[torch.Tensor]) -> None:
        """`state`: `config.state_per_param` tensors of the shard's numel in `state_dtype`, placed by the
        shard in its arena (ps_offload.daemon.store.shard_store.Shard); rebound whenever the arena moves."""
        if len(state) != self.config.state_per_param:
            raise ValueError(
                f"{type(self.config).__name__} needs {self.config.state_per_param} state tensors, got {len(state)}"
            )
        self.state = state

    def apply_momentum(
        self, master: torch.Tensor, momentum: torch.Tensor | OneBitGradient, lr: float, variance_frozen_at: int
    ) -> None:
        """1-bit Adam's step (AdamW only): exp_avg = `momentum` (fp32 with the shard's numel,
        or ONEBIT signs and scales, applied fused), exp_avg_sq as it was after
        `variance_frozen_at` updates; see kernels/fused_adamw.py."""
        config = self.config
        if not isinstance(config, AdamWConfig):
            raise TypeError(f"momentum pushes are 1-bit Adam's; this shard runs {type(config).__name__}")
        self.step += 1
        m, v = self.state
        args = dict(
            segments=self._pieces,
            step=int(self.step.item()),
            variance_frozen_at=variance_frozen_at,
            lr=lr,
            beta1=config.beta1,
            beta2=config.beta2,
            eps=config.eps,
        )
        if isinstance(momentum, OneBitGradient):
            with KERNEL_LOCK:
                onebit_adam_(master, m, v, momentum.bits, momentum.scales, **args)
        else:
            adam_frozen_variance_(master, m, v, momentum, **args)

    def apply(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        lr: float,
        groups: Sequence[GroupHyperparams] = (),
        *,
        multiplier: float | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        """One optimizer step: master -= update(grad * multiplier). `grad` has the shard's
        numel, in fp32, bf16 or fp16 (widened exactly in the step); `multiplier` (an fp32
        product, as torch.mul by an fp32 scalar) None for 1. `groups` empty: the registered
        settings with `lr` and each parameter's weight decay; else `groups[g]` for the
        parameters of group g (all `group_count` of them, checked by the push) and `lr` is
        not read. `out` (fp32, bf16 or fp16, the shard's numel): the new values as
        `master.to(out.dtype)`, written in the same pass."""
        self.step += 1
        if groups:
            calls = [(("group", g), segments, groups[g]) for g, segments in self._segments_by_group.items()]
        else:
            calls = [
                (("decay", d), segments, self._registered(lr, d)) for d, segments in self._segments_by_decay.items()
            ]
        # Torch's kernels on a gradient in the state's dtype (a pass more for fp32 state) until
        # the one-pass kernel is ready (module docstring).
        if self.state_dtype != torch.float32:
            calibration = step_calibration.ready(step_calibration.BF16_STATE, self.state_dtype)
            vector = bf16_state_step.VECTOR_FACTOR * calibration.vector if calibration else 0
            if calibration is None or grad.dtype != self.state_dtype:  # (or decompressed, or fp32 sent wide)
                grad, multiplier = _narrowed(grad, multiplier, self.state_dtype), None
        else:
            calibration = step_calibration.ready("adamw" if isinstance(self.config, AdamWConfig) else "sgd", grad.dtype)
            vector = calibration.vector if calibration else 0
            if calibration is None:
                grad = _widened(grad, multiplier)
        if calibration is None:
            for _, segments, settings in calls:
                self._step_runs(master, grad, [run for s in segments for run in kernel_runs(s)], settings)
            if out is not None:
                out.copy_(master)  # rounds as Tensor.to
        else:
            for key, segments, settings in calls:
                tasks = self._tasks.get(key)
                if tasks is None:
                    tasks = self._tasks[key] = _one_pass_tasks(segments, vector)
                self._step_in_one_pass(master, grad, tasks, settings, multiplier, out, calibration)
        if faults.after_update(master, self.step) and out is not None:  # tests only: PS_OFFLOAD_FAULT_PERTURB_STEP
            out.copy_(master)  # the pull the push carries sees the fault, as any pull would

    def _step_in_one_pass(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        tasks: np.ndarray,
        settings: GroupHyperparams,
        multiplier: float | None,
        out: torch.Tensor | None,
        calibration: step_calibration.Calibration,
    ) -> None:
        """One group's step over its pieces of the shard, in one pass (kernels/fused_step.py)."""
        config, step = self.config, int(self.step.item())
        if isinstance(config, AdamWConfig):
            m, v = self.state
            step_ = bf16_state_step.adamw_ if self.state_dtype == torch.bfloat16 else fused_step.adamw_
            step_(
                tasks, master, grad, m, v, step=step, lr=settings.lr, beta1=settings.beta1,
                beta2=settings.beta2, eps=settings.eps, weight_decay=settings.weight_decay,
                tail=calibration.adamw_tail, grad_multiplier=multiplier, out=out,
            )  # fmt: skip
        else:
            fused_step.sgd_(
                tasks, master, grad, self.state[0] if config.momentum else None, lr=settings.lr,
                weight_decay=settings.weight_decay, momentum=settings.momentum, dampening=settings.dampening,
                nesterov=config.nesterov, first_step=step == 1, tail=calibration.sgd_tail, grad_multiplier=multiplier,
                out=out,
            )  # fmt: skip

    def _registered(self, lr: float, weight_decay: float) -> GroupHyperparams:
        config = self.config
        if isinstance(config, AdamWConfig):
            return GroupHyperparams(lr, weight_decay, beta1=config.beta1, beta2=config.beta2, eps=config.eps)
        return GroupHyperparams(lr, weight_decay, momentum=config.momentum, dampening=config.dampening)

    def _step_runs(
        self, master: torch.Tensor, grad: torch.Tensor, runs: list[KernelRun], settings: GroupHyperparams
    ) -> None:
        """One call of torch's fused kernel over `runs` (ps_proto/plan.py `kernel_runs`) with one
        group's settings and the shard's gradient in the state's dtype: where the one-pass
        kernel does not compute as this torch build does, and for bf16 state."""
        config = self.config
        # Per run, the tensors the kernel gets: master, grad, then each state tensor.
        tensors: list[list[torch.Tensor]] = [[] for _ in range(2 + len(self.state))]
        scratches = []
        for run in runs:
            piece = slice(run.shard_start, run.shard_start + run.numel)
            sources = [master[piece], grad[piece], *(s[piece] for s in self.state)]
            if run.context:
                # A partial block: zero padding around it (elementwise kernels, so the
                # padding only places the elements where the whole parameter has them).
                scratch = torch.zeros(len(sources), run.context, dtype=self.state_dtype)
                inner = slice(run.context_start, run.context_start + run.numel)
                for row, source in zip(scratch, sources, strict=True):
                    row[inner] = source
                scratches.append((scratch, inner, sources))
                sources = list(scratch)
            for column, tensor in zip(tensors, sources, strict=True):
                column.append(tensor)
        params, grads, *state = tensors
        if isinstance(config, AdamWConfig):
            exp_avgs, exp_avg_sqs = state
            torch._fused_adamw_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                [self.step] * len(params),
                lr=settings.lr,
                beta1=settings.beta1,
                beta2=settings.beta2,
                weight_decay=settings.weight_decay,
                eps=settings.eps,
                amsgrad=False,
                maximize=False,
            )
        else:
            # The buffer is the registered momentum's; a push's groups keep its momentum
            # nonzero exactly when the registered one is (ps_offload.daemon.store.push), so torch's
            # "first step" is this shard's first update, as here.
            torch._fused_sgd_(
                params,
                grads,
                state[0] if config.momentum else [],
                weight_decay=settings.weight_decay,
                momentum=settings.momentum,
                lr=settings.lr,
                dampening=settings.dampening,
                nesterov=config.nesterov,
                maximize=False,
                is_first_step=bool(self.step.item() == 1),
            )
        for scratch, inner, sources in scratches:
            for index, (row, target) in enumerate(zip(scratch, sources, strict=True)):
                if index != 1:  # all but the gradient, which is only read
                    target.copy_(row[inner])
