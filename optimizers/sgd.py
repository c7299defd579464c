"""SGD with momentum, bit for bit with torch.optim.SGD(fused=True): a momentum buffer per
parameter (none without momentum), any cut.

A push's groups keep the momentum nonzero exactly when the registered one is: torch's fused
SGD starts a buffer (its "first step") the first time a group's momentum is nonzero, and the
daemon's buffer is the registered momentum's, so a zero where the buffer exists, or the
reverse, would part from torch.optim.SGD. Nesterov is fixed at registration. bf16 state is
refused: torch 2.13's fused CPU SGD kernel, for bf16, stores no parameter in its vector loop
and loads the bf16 momentum buffer as fp32 words (measured: 64 bf16 weights, 3 steps of lr
0.5, none moved), so bf16 SGD has no torch reference worth matching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ps_offload.kernels import fused_step
from ps_offload.optimizers.base import GroupSettings, OptimizerConfig, check_config, check_number, float_of
from ps_offload.optimizers.fused import FusedPlugin, probe_draws
from ps_offload.proto import ps_pb2


@dataclass(frozen=True)
class SGD(OptimizerConfig):
    """SGD with momentum as torch.optim.SGD defines it, run on the daemons."""

    lr: float = 1e-3
    """Learning rate of the first step; `opt.lr = value` between steps follows a schedule."""
    momentum: float = 0.0
    """Momentum factor; 0 keeps no momentum buffer."""
    dampening: float = 0.0
    """Dampening of the momentum's gradient term."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient; parameters that `no_weight_decay` picks get none."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0 and dampening 0, as torch requires)."""

    def __post_init__(self) -> None:
        check_config(self, at_least_zero=("lr", "momentum", "weight_decay"))
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD(nesterov=True) needs momentum > 0 and dampening = 0")


class SGDPlugin(FusedPlugin):
    name = "sgd"
    config_type = SGD
    group_fields = ("lr", "weight_decay", "momentum", "dampening")
    fixed_settings = ("nesterov",)
    state_dtype_note = (
        ": torch's fused CPU SGD leaves bf16 parameters unchanged in its vector loop, so bf16 SGD has no exact "
        "torch reference to match"
    )
    calibration_key = "sgd"

    def state_names(self, config: SGD) -> tuple[str, ...]:
        return ("momentum_buffer",) if config.momentum else ()

    def bounds(self, config: SGD) -> list[tuple[str, float, float]]:
        return [("momentum", 0.0, math.inf), ("dampening", -math.inf, math.inf)]

    def to_proto(self, config: SGD) -> ps_pb2.OptimizerSpec:
        return ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(**self.to_dict(config)))

    def from_proto(self, spec: ps_pb2.OptimizerSpec) -> SGD:
        o = spec.sgd
        return SGD(lr=o.lr, momentum=o.momentum, dampening=o.dampening, weight_decay=o.weight_decay,
                   nesterov=o.nesterov)  # fmt: skip

    def torch_defaults(self, config: SGD) -> dict:
        return self.to_dict(config)

    def group_settings(self, group: dict) -> dict[str, float]:
        return {name: float_of(group[name]) for name in self.group_fields}

    def check_group(self, config: SGD, group: GroupSettings, name: str) -> str:
        for field, low in (("momentum", 0.0), ("dampening", -math.inf)):
            problem = check_number(getattr(group, field), f"{name}.{field}", low=low)
            if problem:
                return problem
        if (group.momentum > 0) != (config.momentum > 0):
            return (
                f"{name}.momentum must be {'> 0' if config.momentum else '0'} (the model was registered "
                f"with momentum {config.momentum:g}, which decides whether the daemon keeps a momentum buffer), "
                f"got {group.momentum:g}"
            )
        if config.nesterov and group.dampening != 0:
            return f"{name}.dampening must be 0 with nesterov momentum, got {group.dampening:g}"
        return ""

    # -- the daemon's step ---------------------------------------------------------------

    def one_pass(self, shard, tasks, master, grad, settings, multiplier, out, calibration) -> None:
        config = shard.config
        fused_step.sgd_(
            tasks, master, grad, shard.state[0] if config.momentum else None, lr=settings.lr,
            weight_decay=settings.weight_decay, momentum=settings.momentum, dampening=settings.dampening,
            nesterov=config.nesterov, first_step=int(shard.step.item()) == 1, tail=calibration.sgd_tail,
            grad_multiplier=multiplier, out=out,
        )  # fmt: skip

    def torch_kernel(self, shard, params, grads, state, settings) -> None:
        # The buffer is the registered momentum's (module docstring), so torch's "first step" is
        # this shard's first update, as here.
        torch._fused_sgd_(
            params, grads, state[0] if shard.config.momentum else [], weight_decay=settings.weight_decay,
            momentum=settings.momentum, lr=settings.lr, dampening=settings.dampening,
            nesterov=shard.config.nesterov, maximize=False, is_first_step=bool(shard.step.item() == 1),
        )  # fmt: skip

    def probe(self) -> bytes:
        """Fused SGD with momentum and weight decay, 3 steps over body and tail lengths."""
        draw = probe_draws()
        params, momentum = draw(), [torch.zeros_like(p) for p in draw()]
        for step in range(1, 4):
            torch._fused_sgd_(params, draw(1e-2), momentum, weight_decay=0.01, momentum=0.9, lr=1e-2, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=step == 1)  # fmt: skip
        return b"".join(t.numpy().tobytes() for t in (*params, *momentum))

    # -- the trainer's references --------------------------------------------------------

    def torch_optimizer(self, config: SGD, param_groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.SGD(param_groups, lr=config.lr, momentum=config.momentum, dampening=config.dampening,
                               nesterov=config.nesterov, fused=True)  # fmt: skip

    def torch_hyper(self, settings: ps_pb2.GroupHyperparams) -> dict:
        return {"lr": settings.lr, "momentum": settings.momentum, "dampening": settings.dampening}

    def torch_reference(self, config, param_groups, placed, step, first) -> torch.optim.Optimizer:
        # `first`: the defaults torch checks nesterov against; every group sets its own.
        torch_opt = torch.optim.SGD(param_groups, momentum=first.momentum, dampening=first.dampening,
                                    nesterov=config.nesterov, fused=True)  # fmt: skip
        if config.momentum and step:  # at step 0 torch makes the buffer (its "first step"), as the daemon
            for param, (buffer,), *_ in placed:
                torch_opt.state[param] = {"momentum_buffer": buffer}
        return torch_opt

    def torch_state_keys(self, config: SGD) -> tuple[str, ...]:
        return ("momentum_buffer",) if config.momentum else ()


PLUGIN = SGDPlugin()
