"""What AdamW and SGD share: torch's fused CPU kernels over the pieces of a shard, the one-pass
kernel once calibrated, and the audit's recompute with torch.optim itself.

Each step runs torch's fused CPU kernel (`torch._fused_adamw_`, `torch._fused_sgd_`, the
kernels behind `torch.optim.AdamW(fused=True)` and `SGD(fused=True)`) over each parameter
piece of the shard, never over the shard as one tensor. The kernel's SIMD body and scalar
tail round differently and it puts the tail at the end of each tensor it is given, so a
piece that a shard cut leaves inside a parameter is split into kernel runs
(ps_proto/plan.py, `kernel_runs`): whole aligned blocks in place, a partial block at either
end in a scratch tensor as long as that block. Same kernel, same loop per element, same
inputs: the daemon's parameters are bit-identical to an in-process torch.optim run on the
same gradients, wherever the cuts fall. Once kernels/step_calibration.py has found this torch
build's vector width and tail forms, kernels/fused_step.py steps a group in one pass instead
(the gradient widened, checked and applied, the pull written, block by block).

bf16 state (AdamW only): master, m and v are bf16 tensors, stepped by the same fused torch
kernel on them as AdamW(fused=True) steps a bf16 model's own parameters (it computes in fp32
and rounds each result to bf16). The gradient is what torch would hold in `param.grad`: a
bf16 gradient as it came; times grad_multiplier in fp32 and rounded back to bf16, as
GradScaler's unscale_ does in place; an fp32 one (decompressed, or sent wide) rounded to bf16.
Once calibrated, kernels/bf16_state_step.py steps it in one pass.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from ps_offload.kernels import bf16_state_step, fused_step, step_calibration
from ps_offload.optimizers.base import GroupSettings, OptimizerConfig, OptimizerPlugin, ShardState, StepCall
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import KernelRun, ParamLayout, Segment, ShardSlice, kernel_runs, segments_of


def widened(grad: torch.Tensor, multiplier: float | None) -> torch.Tensor:
    """The fp32 gradient times `multiplier` (as torch.amp's unscale_: an fp32 product)."""
    wide = grad.float()
    if multiplier is not None:
        wide = torch.mul(wide, torch.tensor(multiplier, dtype=torch.float32))
    return wide


def narrowed(grad: torch.Tensor, multiplier: float | None, dtype: torch.dtype) -> torch.Tensor:
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


def probe_draws():
    """A kernel-digest probe's values: drawn with a fixed seed, one tensor per length, the
    lengths exercising a kernel's vector body and its scalar tail (1, 7, 63 and 1031)."""
    generator = torch.Generator().manual_seed(20261127)

    def draw(scale: float = 1.0) -> list[torch.Tensor]:
        return [torch.randn(n, generator=generator) * scale for n in (1, 7, 63, 1031)]

    return draw


class FusedPlugin(OptimizerPlugin):
    """An optimizer torch runs with a fused CPU kernel: element by element, so any cut works."""

    calibration_key: str  # kernels/step_calibration.py's name for its one-pass kernel

    @abstractmethod
    def one_pass(
        self,
        shard: ShardState,
        tasks: np.ndarray,
        master: torch.Tensor,
        grad: torch.Tensor,
        settings: GroupSettings,
        multiplier: float | None,
        out: torch.Tensor | None,
        calibration: step_calibration.Calibration,
    ) -> None:
        """One group's step over its pieces of the shard, in one pass (kernels/fused_step.py)."""

    @abstractmethod
    def torch_kernel(
        self, shard: ShardState, params: list, grads: list, state: list[list], settings: GroupSettings
    ) -> None:
        """torch's fused kernel over lists of run tensors (state: one list per state tensor)."""

    def apply(
        self,
        shard: ShardState,
        master: torch.Tensor,
        grad: torch.Tensor,
        calls: Sequence[StepCall],
        *,
        multiplier: float | None,
        out: torch.Tensor | None,
    ) -> None:
        # Torch's kernels on a gradient in the state's dtype (a pass more for fp32 state) until
        # the one-pass kernel is ready (module docstring).
        if shard.state_dtype != torch.float32:
            calibration = step_calibration.ready(step_calibration.BF16_STATE, shard.state_dtype)
            vector = bf16_state_step.VECTOR_FACTOR * calibration.vector if calibration else 0
            if calibration is None or grad.dtype != shard.state_dtype:  # (or decompressed, or fp32 sent wide)
                grad, multiplier = narrowed(grad, multiplier, shard.state_dtype), None
        else:
            calibration = step_calibration.ready(self.calibration_key, grad.dtype)
            vector = calibration.vector if calibration else 0
            if calibration is None:
                grad = widened(grad, multiplier)
        if calibration is None:
            for _, segments, settings in calls:
                self._step_runs(shard, master, grad, [run for s in segments for run in kernel_runs(s)], settings)
            if out is not None:
                out.copy_(master)  # rounds as Tensor.to
            return
        for key, segments, settings in calls:
            tasks = shard.cache.get(key)
            if tasks is None:
                tasks = shard.cache[key] = _one_pass_tasks(segments, vector)
            self.one_pass(shard, tasks, master, grad, settings, multiplier, out, calibration)

    def _step_runs(
        self,
        shard: ShardState,
        master: torch.Tensor,
        grad: torch.Tensor,
        runs: list[KernelRun],
        settings: GroupSettings,
    ) -> None:
        """One call of torch's fused kernel over `runs` (ps_proto/plan.py `kernel_runs`) with one
        group's settings and the shard's gradient in the state's dtype: where the one-pass
        kernel does not compute as this torch build does, and for bf16 state."""
        # Per run, the tensors the kernel gets: master, grad, then each state tensor.
        tensors: list[list[torch.Tensor]] = [[] for _ in range(2 + len(shard.state))]
        scratches = []
        for run in runs:
            piece = slice(run.shard_start, run.shard_start + run.numel)
            sources = [master[piece], grad[piece], *(s[piece] for s in shard.state)]
            if run.context:
                # A partial block: zero padding around it (elementwise kernels, so the
                # padding only places the elements where the whole parameter has them).
                scratch = torch.zeros(len(sources), run.context, dtype=shard.state_dtype)
                inner = slice(run.context_start, run.context_start + run.numel)
                for row, source in zip(scratch, sources, strict=True):
                    row[inner] = source
                scratches.append((scratch, inner, sources))
                sources = list(scratch)
            for column, tensor in zip(tensors, sources, strict=True):
                column.append(tensor)
        params, grads, *state = tensors
        self.torch_kernel(shard, params, grads, state, settings)
        for scratch, inner, sources in scratches:
            for index, (row, target) in enumerate(zip(scratch, sources, strict=True)):
                if index != 1:  # all but the gradient, which is only read
                    target.copy_(row[inner])

    # -- the audit's reference: torch.optim itself over the same runs ---------------------

    @abstractmethod
    def torch_reference(
        self, config: OptimizerConfig, param_groups: list[dict], placed: list, step: int, first: GroupSettings
    ) -> torch.optim.Optimizer:
        """torch.optim's optimizer over `param_groups`, its state set from `placed` (param,
        state tensors, ...) as the shard's before a step whose count before is `step`."""

    def torch_hyper(self, settings: ps_pb2.GroupHyperparams) -> dict:
        """A group's settings as torch.optim param_group keys (besides params and weight_decay)."""
        return {"lr": settings.lr}

    def recompute(
        self,
        config: OptimizerConfig,
        shard: ShardSlice,
        layouts: list[ParamLayout],
        group_of: list[int],
        before: list[torch.Tensor],
        grad: torch.Tensor,
        step: int,
        groups: list[ps_pb2.GroupHyperparams],
        state_dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        """torch.optim's step over the shard's kernel runs (each run a parameter of torch.optim, in
        its parameter's group; a scratch run padded with zeros where the whole parameter's block
        has its other elements), so every element lands in the loop it lands in on the daemon."""
        runs_by_group: dict[int, list] = defaultdict(list)
        for segment in segments_of(shard, layouts):
            runs_by_group[group_of[segment.param_index]].extend(kernel_runs(segment))
        placed = []  # (torch parameter, its state tensors, the run's elements in it, in the shard)
        param_groups = []
        for group, runs in sorted(runs_by_group.items()):
            params = []
            for run in runs:
                inner = slice(run.context_start, run.context_start + run.numel)
                piece = slice(run.shard_start, run.shard_start + run.numel)
                tensors = [torch.zeros(run.context or run.numel, dtype=state_dtype) for _ in range(1 + len(before))]
                for tensor, source in zip(tensors, [before[0], grad, *before[1:]], strict=True):
                    tensor[inner] = source[piece]
                param, param_grad, *state = tensors
                param.grad = param_grad
                params.append(param)
                placed.append((param, state, inner, piece))
            settings = groups[group]
            param_groups.append({"params": params, "weight_decay": settings.weight_decay, **self.torch_hyper(settings)})
        torch_opt = self.torch_reference(config, param_groups, placed, step, groups[0])
        torch_opt.step()
        after = [t.clone() for t in before]
        for param, state, inner, piece in placed:
            state = [torch_opt.state[param][name] for name in self.torch_state_keys(config)]
            for target, source in zip(after, [param, *state], strict=True):
                target[piece] = source.detach()[inner]  # (widened exactly from bf16 state)
        return after

    @abstractmethod
    def torch_state_keys(self, config: OptimizerConfig) -> tuple[str, ...]:
        """torch.optim's state keys for `state_names`, in the same order."""
