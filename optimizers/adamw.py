"""AdamW, bit for bit with torch.optim.AdamW(fused=True): m and v per parameter, any cut.

bf16 state (ModelSpec.state_dtype): master, m and v in bf16, as torch keeps them for a bf16
model's own parameters. 1-bit Adam's MOMENTUM pushes (`momentum_step`): exp_avg becomes the
trainer's momentum, exp_avg_sq stays frozen, and the master takes AdamW's step; in ONEBIT
encoding kernels.fused_adamw.onebit_adam_ reads the signs and block scales in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ps_offload.kernels import bf16_state_step, fused_step
from ps_offload.kernels.fused_adamw import adam_frozen_variance_, onebit_adam_
from ps_offload.optimizers.base import AdamMoments, OptimizerConfig, ShardState, check_config
from ps_offload.optimizers.fused import FusedPlugin, probe_draws
from ps_offload.proto import ps_pb2


@dataclass(frozen=True)
class AdamW(OptimizerConfig):
    """AdamW as torch.optim.AdamW defines it, run on the daemons."""

    lr: float = 1e-3
    """Learning rate of the first step; `opt.lr = value` between steps follows a schedule."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates."""
    eps: float = 1e-8
    """Added to the square root of the second moment, for numerical stability."""
    weight_decay: float = 1e-2
    """Decoupled weight decay; parameters that `no_weight_decay` picks get none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        check_config(self, at_least_zero=("lr", "eps", "weight_decay"))

    @property
    def beta1(self) -> float:
        return self.betas[0]

    @property
    def beta2(self) -> float:
        return self.betas[1]


class AdamWPlugin(AdamMoments, FusedPlugin):
    name = "adamw"
    config_type = AdamW
    state_dtypes = ("float32", "bfloat16")
    takes_momentum = True
    calibration_key = "adamw"

    def to_proto(self, config: AdamW) -> ps_pb2.OptimizerSpec:
        return ps_pb2.OptimizerSpec(adamw=ps_pb2.AdamWSpec(**self.to_dict(config)))

    def from_proto(self, spec: ps_pb2.OptimizerSpec) -> AdamW:
        o = spec.adamw
        return AdamW(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)

    # -- the daemon's step ---------------------------------------------------------------

    def one_pass(self, shard, tasks, master, grad, settings, multiplier, out, calibration) -> None:
        m, v = shard.state
        step_ = bf16_state_step.adamw_ if shard.state_dtype == torch.bfloat16 else fused_step.adamw_
        step_(
            tasks, master, grad, m, v, step=int(shard.step.item()), lr=settings.lr, beta1=settings.beta1,
            beta2=settings.beta2, eps=settings.eps, weight_decay=settings.weight_decay, tail=calibration.adamw_tail,
            grad_multiplier=multiplier, out=out,
        )  # fmt: skip

    def torch_kernel(self, shard, params, grads, state, settings) -> None:
        exp_avgs, exp_avg_sqs = state
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], [shard.step] * len(params), lr=settings.lr,
            beta1=settings.beta1, beta2=settings.beta2, weight_decay=settings.weight_decay, eps=settings.eps,
            amsgrad=False, maximize=False,
        )  # fmt: skip

    def momentum_step(
        self,
        shard: ShardState,
        pieces: list[tuple[int, int, float]],
        master: torch.Tensor,
        momentum: torch.Tensor | object,
        lr: float,
        variance_frozen_at: int,
        kernel_lock,
    ) -> None:
        """1-bit Adam's step (module docstring): `momentum` fp32 with the shard's numel, or a
        ONEBIT gradient (bits and scales), applied fused; `pieces` (start, end, decay) in order."""
        config, (m, v) = shard.config, shard.state
        args = dict(segments=pieces, step=int(shard.step.item()), variance_frozen_at=variance_frozen_at, lr=lr,
                    beta1=config.beta1, beta2=config.beta2, eps=config.eps)  # fmt: skip
        if isinstance(momentum, torch.Tensor):
            adam_frozen_variance_(master, m, v, momentum, **args)
        else:
            with kernel_lock:
                onebit_adam_(master, m, v, momentum.bits, momentum.scales, **args)

    def probe(self) -> bytes:
        """Fused AdamW, weight decay on, 3 steps over lengths that exercise body and tail."""
        draw = probe_draws()
        params, m, v = draw(), [torch.zeros_like(p) for p in draw()], [torch.zeros_like(p) for p in draw()]
        for step in range(1, 4):
            grads = draw(1e-2)
            torch._fused_adamw_(params, grads, m, v, [], [torch.tensor(float(step))] * len(params), lr=1e-3,
                                beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False,
                                maximize=False)  # fmt: skip
        return b"".join(t.numpy().tobytes() for t in (*params, *m, *v))

    # -- the trainer's references --------------------------------------------------------

    def torch_optimizer(self, config: AdamW, param_groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=True)

    def torch_hyper(self, settings: ps_pb2.GroupHyperparams) -> dict:
        return {"lr": settings.lr, "betas": (settings.beta1, settings.beta2), "eps": settings.eps}

    def torch_reference(self, config, param_groups, placed, step, first) -> torch.optim.Optimizer:
        torch_opt = torch.optim.AdamW(param_groups, fused=True)
        for param, (exp_avg, exp_avg_sq), *_ in placed:
            # The step count before this step: torch adds 1, as the daemon does, before the kernel.
            torch_opt.state[param] = {
                "step": torch.tensor(float(step), dtype=torch.float32), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
            }  # fmt: skip
        return torch_opt

    def torch_state_keys(self, config: AdamW) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")


PLUGIN = AdamWPlugin()
