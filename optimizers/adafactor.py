"""Adafactor, bit for bit with torch.optim.Adafactor in one process: a factored second moment,
so its state is a row and a column per matrix instead of a value per element.

For a parameter of shape (..., R, C) the state is R + C values per matrix (torch's row_var and
col_var); a vector (or a scalar) keeps one value per element (its variance). Against AdamW's 8
bytes per parameter this is what an offload user pays for in RAM and on disk: a 4096 x 4096
weight keeps 32 KiB of state instead of 128 MiB.

The step is torch's own: each whole parameter of a shard (the row and column means, and the
parameter's norm that scales its step, need all of it: `whole_params`) is stepped by a
torch.optim.Adafactor (foreach off, as torch picks on CPU) over views of the shard's arena,
its state set to the arena's row_var / col_var / variance and to the shard's step count. Its
full-parameter norms are reduced by torch's intra-op threads; for a parameter of 32768
elements or more (torch's grain) the reduction's order, and so the last bit, follows the
thread count: the daemon equals an in-process run at the same count (store.optimizer_threads
against torch.get_num_threads()).

Factored state has no value per element, so what lays state out per element is refused,
saying why: STATE pushes (snapshot restore onto other daemons, replica repair), EXP_AVG pulls,
snapshot exports, replicas and the parity audit. Snapshots restored on the daemons that took
them, the NVMe tier and drops work as for any model. fp32 state only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ps_offload.optimizers.base import GroupSettings, OptimizerConfig, OptimizerPlugin, ShardState, StepCall, float_of
from ps_offload.optimizers.fused import probe_draws, widened
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ParamLayout, ShardSlice


@dataclass(frozen=True)
class Adafactor(OptimizerConfig):
    """Adafactor as torch.optim.Adafactor defines it (same arguments, same defaults), run on
    the daemons over whole parameters."""

    lr: float = 1e-2
    """Learning rate of the first step (torch's Adafactor takes min(lr, 1/sqrt(step)))."""
    beta2_decay: float = -0.8
    """The second moment's decay rate is 1 - step ** beta2_decay; <= 0."""
    eps: tuple[float | None, float] = (None, 1e-3)
    """(eps1, eps2): eps1 floors the second moment (None: fp32's epsilon); eps2 floors the
    parameter's RMS that scales the step."""
    d: float = 1.0
    """Clipping threshold of the update's RMS; >= 1."""
    weight_decay: float = 0.0
    """Decoupled weight decay; parameters that `no_weight_decay` picks get none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", tuple(self.eps))
        eps1, eps2 = self.eps if len(self.eps) == 2 else (None, math.nan)
        problems = [
            (not self.lr >= 0, f"lr must be >= 0, got {self.lr}"),
            (not self.beta2_decay <= 0, f"beta2_decay must be <= 0, got {self.beta2_decay}"),
            (len(self.eps) != 2, f"eps must be (eps1 or None, eps2), got {self.eps!r}"),
            (eps1 is not None and not eps1 >= 0, f"eps1 must be None or >= 0, got {eps1}"),
            (not eps2 >= 0, f"eps2 must be >= 0, got {eps2}"),
            (not self.d >= 1, f"d must be >= 1, got {self.d}"),
            (not self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
        ]
        for failed, problem in problems:
            if failed:
                raise ValueError(f"Adafactor {problem}")


def factored_numel(shape: Sequence[int]) -> int:
    """State values of a parameter of `shape`: R + C per (R, C) matrix, else one per element."""
    if len(shape) > 1:
        return math.prod(shape[:-2]) * (shape[-2] + shape[-1])
    return math.prod(shape)


def _state_views(state: torch.Tensor, offset: int, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """torch.optim.Adafactor's state tensors of one parameter, as views of the shard's state."""
    if len(shape) > 1:
        batch, rows, cols = shape[:-2], shape[-2], shape[-1]
        count = math.prod(batch)
        row_var = state[offset : offset + count * rows].view(*batch, rows, 1)
        col_var = state[offset + count * rows : offset + count * (rows + cols)].view(*batch, 1, cols)
        return {"row_var": row_var, "col_var": col_var}
    return {"variance": state[offset : offset + math.prod(shape)].view(shape)}


def step_param_(param: torch.Tensor, grad: torch.Tensor, state: dict, step: int, settings: GroupSettings) -> None:
    """One torch.optim.Adafactor step of one whole parameter (shaped as the model's) with its
    state tensors (`_state_views`), from `step` - 1 updates to `step`."""
    param.grad = grad
    eps1 = settings.setting("eps1")
    torch_opt = torch.optim.Adafactor(
        [param], lr=settings.lr, beta2_decay=settings.setting("beta2_decay", -0.8),
        eps=(eps1, settings.setting("eps2", 1e-3)), d=settings.setting("d", 1.0),
        weight_decay=settings.weight_decay, foreach=False,
    )  # fmt: skip
    torch_opt.state[param] = {"step": torch.tensor(float(step - 1), dtype=torch.float32), **state}
    torch_opt.step()
    param.grad = None


class AdafactorPlugin(OptimizerPlugin):
    name = "adafactor"
    config_type = Adafactor
    whole_params = True
    per_element_state = False
    extra_fields = ("beta2_decay", "eps1", "eps2", "d")

    def state_names(self, config: Adafactor) -> tuple[str, ...]:
        return ("factored_variance",)

    def state_numels(self, config: Adafactor, shapes: Sequence[tuple[int, ...]], numel: int) -> tuple[int, ...]:
        return (sum(factored_numel(shape) for shape in shapes),)

    def bounds(self, config: Adafactor) -> list[tuple[str, float, float]]:
        return [("beta2_decay", -math.inf, 0.0), ("d", 1.0, math.inf)]

    def to_dict(self, config: Adafactor) -> dict:
        return {"lr": config.lr, "beta2_decay": config.beta2_decay, "eps1": config.eps[0], "eps2": config.eps[1],
                "d": config.d, "weight_decay": config.weight_decay}  # fmt: skip

    def from_dict(self, data: dict) -> Adafactor:
        data = dict(data)
        return Adafactor(eps=(data.pop("eps1", None), data.pop("eps2", 1e-3)), **data)

    def to_proto(self, config: Adafactor) -> ps_pb2.OptimizerSpec:
        settings = {k: float(v) for k, v in self.to_dict(config).items() if v is not None}  # eps1 None: absent
        return ps_pb2.OptimizerSpec(plugin=ps_pb2.PluginOptimizerSpec(name=self.name, settings=settings))

    def torch_defaults(self, config: Adafactor) -> dict:
        return {"lr": config.lr, "beta2_decay": config.beta2_decay, "eps": tuple(config.eps), "d": config.d,
                "weight_decay": config.weight_decay}  # fmt: skip

    def group_settings(self, group: dict) -> dict:
        eps1, eps2 = group["eps"]
        settings = {"beta2_decay": float_of(group["beta2_decay"]), "eps2": float_of(eps2), "d": float_of(group["d"])}
        if eps1 is not None:
            settings["eps1"] = float_of(eps1)
        return {"lr": float_of(group["lr"]), "weight_decay": float_of(group["weight_decay"]), "settings": settings}

    def registered(self, config: Adafactor, lr: float, weight_decay: float) -> GroupSettings:
        extra = {"beta2_decay": config.beta2_decay, "eps2": config.eps[1], "d": config.d}
        if config.eps[0] is not None:
            extra["eps1"] = config.eps[0]
        return GroupSettings(lr, weight_decay, extra=tuple(sorted(extra.items())))

    def check_group(self, config: Adafactor, group: GroupSettings, name: str) -> str:
        for field, low, high in (("beta2_decay", -math.inf, 0.0), ("eps1", 0.0, math.inf), ("eps2", 0.0, math.inf),
                                 ("d", 1.0, math.inf)):  # fmt: skip
            value = group.setting(field)
            if value is None:
                if field != "eps1":  # (eps1 absent is torch's None)
                    return f"{name}.settings must hold {field}"
            elif not (math.isfinite(value) and low <= value <= high):
                return f"{name}.settings[{field!r}] must be finite and in [{low:g}, {high:g}], got {value}"
        return ""

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
        grad = widened(grad, multiplier)
        offsets = shard.cache.get("offsets")
        if offsets is None:  # each parameter's place in the shard's factored state
            offsets, at = {}, 0
            for seg in shard.segments:
                offsets[seg.param_index] = at
                at += factored_numel(shard.shapes[seg.param_index])
            shard.cache["offsets"] = offsets
        step = int(shard.step.item())
        for _, segments, settings in calls:
            for seg in segments:
                if seg.numel != seg.param_numel:  # the plan keeps parameters whole (whole_params)
                    raise RuntimeError(f"Adafactor got {seg.numel} of a parameter's {seg.param_numel} elements")
                shape, piece = shard.shapes[seg.param_index], slice(seg.shard_start, seg.shard_start + seg.numel)
                state = _state_views(shard.state[0], offsets[seg.param_index], shape)
                step_param_(master[piece].view(shape), grad[piece].view(shape), state, step, settings)
        if out is not None:
            out.copy_(master)  # rounds as Tensor.to

    def probe(self) -> bytes:
        """torch's Adafactor with weight decay, 3 steps, over the probe's vectors and a matrix."""
        draw = probe_draws()
        params = [*draw(), torch.randn(33, 31, generator=torch.Generator().manual_seed(20261129))]
        states = [_state_views(torch.zeros(factored_numel(p.shape)), 0, tuple(p.shape)) for p in params]
        settings = self.registered(Adafactor(), 1e-2, 0.1)
        for step in range(1, 4):
            grads = [*draw(1e-2), params[-1] * 1e-2]
            for p, g, state in zip(params, grads, states, strict=True):
                step_param_(p, g, state, step, settings)
        return b"".join(t.numpy().tobytes() for t in (*params, *(v for s in states for v in s.values())))

    def torch_optimizer(self, config: Adafactor, param_groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(param_groups, lr=config.lr, beta2_decay=config.beta2_decay, eps=config.eps,
                                     d=config.d, foreach=False)  # fmt: skip

    def recompute(
        self,
        config: Adafactor,
        shard: ShardSlice,
        layouts: list[ParamLayout],
        group_of: list[int],
        before: list[torch.Tensor],
        grad: torch.Tensor,
        step: int,
        groups: list[ps_pb2.GroupHyperparams],
        state_dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        raise ValueError("the parity audit compares state element by element; Adafactor's state is factored")


PLUGIN = AdafactorPlugin()
