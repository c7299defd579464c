"""A shard's optimizer: its state tensors, its step count and its update, stepped by the
model's optimizer plug-in (ps_offload.optimizers: AdamW, SGD, LAMB, each equal to its
reference for any cut the plan makes).

A GRADIENT push may carry the settings of every param group for its step (a torch LR
scheduler changes them between steps): each parameter is then stepped with its own group's
settings, one plug-in call per group, as torch.optim steps one group at a time. Without them
the registered settings apply, with each parameter's weight decay and the push's lr. A
MOMENTUM push (1-bit Adam's compression stage) is applied by the plug-in that takes one
(`takes_momentum`: AdamW). Compressed GRADIENT pushes reach `apply` decompressed
(ShardStore.push); RAW and BF16/FP16 ones as they came, widened in the step.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from ps_offload.daemon.model import faults
from ps_offload.daemon.model.encodings import KERNEL_LOCK, OneBitGradient
from ps_offload.optimizers import GroupSettings, OptimizerConfig, ShardState, plugin_of
from ps_offload.proto.plan import Segment

log = logging.getLogger(__name__)


def log_calibration(found: Future) -> None:
    """Says which way the daemon steps, once the one-pass kernel's calibration is known."""
    if found.exception() is None and found.result() is not None:
        log.info("one-pass optimizer kernel calibrated against torch %s: %s", torch.__version__, found.result())
    else:
        log.warning(
            "the one-pass optimizer kernel does not compute as this torch build's fused AdamW and SGD: the daemon "
            "steps with torch's kernels (bit for bit as before, with a pass more over each gradient)"
        )


def state_tensors(config: OptimizerConfig) -> int:
    """How many state tensors of a shard's numel the optimizer keeps (AdamW 2, SGD 0 or 1)."""
    return len(plugin_of(config).state_names(config))


class ShardOptimizer(ShardState):
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
        shapes: dict[int, tuple[int, ...]] | None = None,
    ) -> None:
        """Per segment: its parameter's weight decay (registered) and param group (an index
        below `group_count`, the model's number of groups; all 0 if None). `state_dtype`: the
        master's and the state's (fp32 or bf16: ModelSpec.state_dtype). `shapes`: each
        segment's parameter shape by param_index (what a plug-in of whole parameters reads)."""
        super().__init__(
            config, [], torch.zeros((), dtype=torch.float32), state_dtype, {},
            sorted(segments, key=lambda s: s.shard_start), dict(shapes or {}),
        )  # fmt: skip
        self.plugin = plugin_of(config)
        self._state_numels: tuple[int, ...] | None = None
        self.group_count = group_count
        groups = [0] * len(segments) if groups is None else groups
        # Calls by weight decay (registered settings) and by param group (a push's settings):
        # a step takes one scalar of each per call.
        by_decay: dict[float, list[Segment]] = defaultdict(list)
        by_group: dict[int, list[Segment]] = defaultdict(list)
        for segment, decay, group in zip(segments, weight_decays, groups, strict=True):
            by_decay[decay].append(segment)
            by_group[group].append(segment)
        self._segments_by_decay = dict(by_decay)
        self._segments_by_group = dict(by_group)
        # The same pieces in shard order, for the 1-bit Adam update: (start, end, decay).
        self._pieces = sorted(
            (s.shard_start, s.shard_start + s.numel, d) for s, d in zip(segments, weight_decays, strict=True)
        )

    def state_numels(self) -> tuple[int, ...]:
        """Elements of each state tensor (OptimizerPlugin.state_numels), worked out once: every
        arena the shard is attached to (a load, a speculation's swap) is laid out by it."""
        if self._state_numels is None:
            shapes = [self.shapes.get(s.param_index, (s.numel,)) for s in self.segments]
            self._state_numels = self.plugin.state_numels(self.config, shapes, sum(s.numel for s in self.segments))
        return self._state_numels

    def bind(self, state: list[torch.Tensor]) -> None:
        """`state`: the plug-in's state tensors (`state_numels`) in `state_dtype`, placed by the
        shard in its arena (ps_offload.daemon.store.shard.Shard); rebound whenever the arena moves."""
        if [t.numel() for t in state] != list(self.state_numels()):
            raise ValueError(f"{self.plugin.name} needs state tensors of {self.state_numels()} elements")
        self.state = state

    def apply_momentum(
        self, master: torch.Tensor, momentum: torch.Tensor | OneBitGradient, lr: float, variance_frozen_at: int
    ) -> None:
        """1-bit Adam's step: exp_avg = `momentum` (fp32 with the shard's numel, or ONEBIT signs
        and scales, applied fused), exp_avg_sq as it was after `variance_frozen_at` updates."""
        if not self.plugin.takes_momentum:
            raise TypeError(f"momentum pushes are 1-bit Adam's; this shard runs {self.plugin.name}")
        self.step += 1
        self.plugin.momentum_step(self, self._pieces, master, momentum, lr, variance_frozen_at, KERNEL_LOCK)

    def apply(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        lr: float,
        groups: Sequence[GroupSettings] = (),
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
        plugin = self.plugin
        if groups:
            calls = [(("group", g), segments, groups[g]) for g, segments in self._segments_by_group.items()]
        else:
            calls = [
                (("decay", d), segments, plugin.registered(self.config, lr, d))
                for d, segments in self._segments_by_decay.items()
            ]
        plugin.apply(self, master, grad, calls, multiplier=multiplier, out=out)
        if faults.after_update(master, self.step) and out is not None:  # tests only: PS_OFFLOAD_FAULT_PERTURB_STEP
            out.copy_(master)  # the pull the push carries sees the fault, as any pull would
