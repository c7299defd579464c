"""The optimizer plug-in contract: what the daemons, the trainer and the table ask of one.

An optimizer is one module of this package holding one `OptimizerPlugin` subclass (its config
dataclass, its validation, its state layout, its per-shard step, its kernel-digest probe and
its torch reference) and one line of the table in ps_offload.optimizers. Nothing else of ours
names an optimizer: the daemon, the trainer, ps-admin and the tests reach it through the table.

The contract with the shard plan (docs/protocol.md, "Optimizers"): an optimizer either works
element by element, so any cut of a parameter across shards steps exactly as the whole
parameter would (AdamW, SGD: `whole_params = False`), or it reads whole parameters (a norm,
a row, a column: LAMB's trust ratio) and says `whole_params = True`; the plan then never cuts
one of its parameters across shards (ps_proto/plan.py `whole_param_starts`).

A config is a frozen dataclass deriving from `OptimizerConfig`, with `lr` and `weight_decay`
(a push may override both per param group) and whatever else the optimizer reads; it checks
itself in `__post_init__` (ValueError naming the field), so a trainer fails where it writes
the value and a daemon refuses a registration that carries it.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import Segment

if TYPE_CHECKING:
    from ps_offload.proto.plan import ParamLayout, ShardSlice


class OptimizerConfig:
    """The base of every optimizer's config (a frozen dataclass of its own, so that its fields
    keep the order its torch class takes them in). Each has `lr` (the first step's learning
    rate) and `weight_decay` (parameters that `no_weight_decay` picks get none)."""

    lr: float
    weight_decay: float

    def to_proto(self) -> ps_pb2.OptimizerSpec:
        """The config as ModelSpec.optimizer, through its plug-in."""
        from ps_offload.optimizers import plugin_of  # (the table imports this module)

        return plugin_of(self).to_proto(self)


@dataclass(frozen=True)
class GroupSettings:
    """One param group's settings for one step (proto GroupHyperparams). Each optimizer reads
    the fields it names in `OptimizerPlugin.group_fields`; the rest stay 0."""

    lr: float
    weight_decay: float
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    extra: tuple[tuple[str, float], ...] = ()  # GroupHyperparams.settings, sorted by name

    def setting(self, name: str, default: float | None = None) -> float | None:
        """One of `extra` by name; `default` when absent."""
        return dict(self.extra).get(name, default)


@dataclass(eq=False)
class ShardState:
    """What a plug-in's step reads and writes of one shard, besides master and gradient (the
    daemon's ShardOptimizer is one): `state` the tensors `state_names` names, of the sizes
    `state_numels` gives, in `state_dtype`; `step` the count of applied updates (fp32 scalar,
    already moved to this step's number when `apply` runs); `segments` the shard's parameter
    pieces in shard order and `shapes` each one's parameter shape (by param_index); `cache` a
    plug-in's per-shard memo."""

    config: OptimizerConfig
    state: list[torch.Tensor]
    step: torch.Tensor
    state_dtype: torch.dtype
    cache: dict
    segments: list[Segment] = dataclasses.field(default_factory=list)
    shapes: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)


# (key, the segments of the shard one kernel call steps, their settings): a shard's step is
# one call per param group (a push's settings) or per weight decay (the registered ones).
StepCall = tuple[tuple[str, float], list["Segment"], GroupSettings]


class OptimizerPlugin(ABC):
    """One optimizer, for the daemons and the trainer. Subclasses set the class attributes and
    implement the abstract methods; the defaults suit an optimizer without 1-bit Adam or bf16
    state."""

    name: ClassVar[str]  # the table's key, the spec's JSON "type" and PluginSpec.name
    config_type: ClassVar[type[OptimizerConfig]]
    whole_params: ClassVar[bool] = False  # see the module docstring
    group_fields: ClassVar[tuple[str, ...]] = ("lr", "weight_decay")  # GroupSettings fields it reads
    fixed_settings: ClassVar[tuple[str, ...]] = ()  # torch param_group keys that may not change after registration
    state_dtypes: ClassVar[tuple[str, ...]] = ("float32",)  # ModelSpec.state_dtype values it steps exactly
    state_dtype_note: ClassVar[str] = ""  # why not another state dtype, for the refusal's message
    takes_momentum: ClassVar[bool] = False
    extra_fields: ClassVar[tuple[str, ...]] = ()  # GroupHyperparams.settings names it reads
    # Its state has one value per element (each state tensor as long as the shard): what STATE
    # pushes, EXP_AVG pulls, snapshot exports, replica repair and the parity audit lay out.
    # False (factored state): those are refused, saying why.
    per_element_state: ClassVar[bool] = True  # MOMENTUM pushes (1-bit Adam)

    # -- the config ----------------------------------------------------------------------

    @abstractmethod
    def state_names(self, config: OptimizerConfig) -> tuple[str, ...]:
        """Its state tensors, each of a shard's numel, in arena order (proto ShardTensor names
        after "master")."""

    def state_numels(self, config: OptimizerConfig, shapes: Sequence[tuple[int, ...]], numel: int) -> tuple[int, ...]:
        """Elements of each state tensor of a shard of `numel` elements holding pieces of the
        parameters of `shapes` (whole ones when `whole_params`): by default the shard's numel."""
        return (numel,) * len(self.state_names(config))

    def bounds(self, config: OptimizerConfig) -> list[tuple[str, float, float]]:
        """(field, low, high) the daemon checks beyond lr and weight_decay: finite and in range."""
        return []

    def to_dict(self, config: OptimizerConfig) -> dict:
        """The spec file's form (without "type"); `from_dict` reads it back."""
        return dataclasses.asdict(config)

    def from_dict(self, data: dict) -> OptimizerConfig:
        return self.config_type(**data)

    def to_proto(self, config: OptimizerConfig) -> ps_pb2.OptimizerSpec:
        """A plug-in's spec on the wire: its name and its numbers (bools as 0 and 1)."""
        settings = {k: float(v) for k, v in self.to_dict(config).items()}
        return ps_pb2.OptimizerSpec(plugin=ps_pb2.PluginOptimizerSpec(name=self.name, settings=settings))

    def from_proto(self, spec: ps_pb2.OptimizerSpec) -> OptimizerConfig:
        """The config of a spec whose kind names this plug-in (settings by their `to_dict` names,
        the defaults for those left out); ValueError naming what is wrong."""
        defaults = self.to_dict(self.config_type())
        settings = dict(spec.plugin.settings)
        unknown = sorted(set(settings) - set(defaults))
        if unknown:
            raise ValueError(f"{self.name} has no setting {unknown[0]!r} (it has {', '.join(defaults)})")
        values = {k: (bool(v) if isinstance(defaults[k], bool) else v) for k, v in settings.items()}
        return self.from_dict({**defaults, **values})

    # -- param groups (the trainer's torch.optim.Optimizer face) -------------------------

    @abstractmethod
    def torch_defaults(self, config: OptimizerConfig) -> dict:
        """torch.optim's `defaults`: the param_group keys a scheduler or a user may change."""

    @abstractmethod
    def group_settings(self, group: dict) -> dict[str, float]:
        """A torch param group's values as GroupHyperparams fields (`group_fields`)."""

    def registered(self, config: OptimizerConfig, lr: float, weight_decay: float) -> GroupSettings:
        """The settings of a push without groups: the registered ones, this `lr`, a parameter's decay."""
        values = {name: getattr(config, name) for name in self.group_fields if name not in ("lr", "weight_decay")}
        return GroupSettings(lr, weight_decay, **values)

    def check_group(self, config: OptimizerConfig, group: GroupSettings, name: str) -> str:
        """'' if a push's `group` (called `name` in the message) is one this optimizer can step,
        else why not (lr and weight decay are checked by the daemon for every optimizer)."""
        return ""

    # -- the daemon's step ---------------------------------------------------------------

    @abstractmethod
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
        """One step of a shard: for each call, its segments with its settings. `grad` has the
        shard's numel, fp32/bf16/fp16; times `multiplier` (an fp32 product; None for 1) before
        use. `out`: the new master as `master.to(out.dtype)`, written in the same step."""

    @abstractmethod
    def probe(self) -> bytes:
        """The bits its kernels compute on a fixed probe (ps_offload.daemon.model.kernel_digest):
        replicas whose probes differ would drift apart."""

    # -- the trainer's references --------------------------------------------------------

    def torch_optimizer(self, config: OptimizerConfig, param_groups: list[dict]) -> torch.optim.Optimizer:
        """The in-process optimizer a PipelineTrainer without daemons runs (LocalOptimizer)."""
        raise NotImplementedError(f"{self.name} has no in-process torch optimizer; run it on the daemons")

    @abstractmethod
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
        """The parity audit's reference (ps_offload.trainer.offload.audit): the shard's master
        and state after one step from `before` (master, then the state tensors; the shard's step
        count `step` before it) with the fp32 gradient and each group's settings, computed by
        the reference the plug-in promises equality with, not by its daemon step."""


class AdamMoments(OptimizerPlugin):
    """What an optimizer with Adam's moments shares (AdamW, LAMB): a config with `betas` and
    `eps`, written beta1 and beta2 in the spec file and on the wire, and read per group."""

    group_fields = ("lr", "weight_decay", "beta1", "beta2", "eps")

    def state_names(self, config: OptimizerConfig) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def state_numels(self, config: OptimizerConfig, shapes: Sequence[tuple[int, ...]], numel: int) -> tuple[int, ...]:
        """Elements of each state tensor of a shard of `numel` elements holding pieces of the
        parameters of `shapes` (whole ones when `whole_params`): by default the shard's numel."""
        return (numel,) * len(self.state_names(config))

    def bounds(self, config: OptimizerConfig) -> list[tuple[str, float, float]]:
        return [("eps", 0.0, math.inf)]

    def to_dict(self, config: OptimizerConfig) -> dict:
        # The spec file's form since the first release: beta1 and beta2 as numbers of their own.
        return {"lr": config.lr, "beta1": config.betas[0], "beta2": config.betas[1], "eps": config.eps,
                "weight_decay": config.weight_decay}  # fmt: skip

    def from_dict(self, data: dict) -> OptimizerConfig:
        data = dict(data)
        defaults = self.config_type().betas
        return self.config_type(betas=(data.pop("beta1", defaults[0]), data.pop("beta2", defaults[1])), **data)

    def torch_defaults(self, config: OptimizerConfig) -> dict:
        return {"lr": config.lr, "betas": tuple(config.betas), "eps": config.eps, "weight_decay": config.weight_decay}

    def group_settings(self, group: dict) -> dict[str, float]:
        beta1, beta2 = group["betas"]
        return {"lr": float_of(group["lr"]), "weight_decay": float_of(group["weight_decay"]),
                "beta1": float_of(beta1), "beta2": float_of(beta2), "eps": float_of(group["eps"])}  # fmt: skip

    def check_group(self, config: OptimizerConfig, group: GroupSettings, name: str) -> str:
        for beta in ("beta1", "beta2"):
            if not 0.0 <= getattr(group, beta) < 1.0:
                return f"{name}.{beta} must be in [0, 1), got {getattr(group, beta)}"
        if not (math.isfinite(group.eps) and group.eps > 0):
            return f"{name}.eps must be finite and > 0, got {group.eps}"
        return ""


def check_config(
    config: OptimizerConfig, *, at_least_zero: tuple[str, ...] = (), positive: tuple[str, ...] = ()
) -> None:
    """A config's own checks (its `__post_init__`): ValueError naming the field. `betas`, when
    the config has them, must be two numbers in [0, 1) (named beta1 and beta2, as on the wire)."""
    name = type(config).__name__
    for field in at_least_zero:
        if not getattr(config, field) >= 0:
            raise ValueError(f"{name} {field} must be >= 0, got {getattr(config, field)}")
    for field in positive:
        if not getattr(config, field) > 0:
            raise ValueError(f"{name} {field} must be > 0, got {getattr(config, field)}")
    betas = getattr(config, "betas", None)
    if betas is None:
        return
    if len(betas) != 2:
        raise ValueError(f"{name}.betas must be two numbers in [0, 1), got {betas!r}")
    for index, beta in enumerate(betas):
        if not 0 <= beta < 1:
            raise ValueError(
                f"{name}.betas must be two numbers in [0, 1): beta{index + 1} must be in [0, 1), got {beta}"
            )


def check_number(value: float, name: str, *, low: float, high: float = math.inf) -> str:
    """'' if `value` is finite and within [low, high], else why not (for a message)."""
    if not math.isfinite(value):
        return f"{name} must be finite, got {value}"
    if not low <= value <= high:
        return f"{name} must be in [{low:g}, {high:g}], got {value:g}"
    return ""


def float_of(value: float | torch.Tensor) -> float:
    """torch.optim allows a tensor lr (and betas); the wire takes a double."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
