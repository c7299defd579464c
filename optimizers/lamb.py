"""LAMB (You et al., "Large Batch Optimization for Deep Learning", 2019): Adam's direction,
scaled per parameter by a trust ratio ||w|| / ||update||, the large-batch optimizer DeepSpeed's
1-bit LAMB builds on. torch has no LAMB; tests/optimizers/test_lamb.py holds a plain-torch
reference it equals bit for bit.

One step of a parameter w with gradient g (times the push's multiplier, in fp32), step t:

    m = beta1 * m + (1 - beta1) * g             v = beta2 * v + (1 - beta2) * g * g
    u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
    trust = ||w|| / ||u||   (1 when either norm is 0)
    w = w - (lr * trust) * u

As the paper's Algorithm 2 without a clamp on the trust ratio (DeepSpeed's FusedLamb clamps it
to [0.01, 10]; apex's does not). Exactness, for any thread count and any shard: each line is
torch's elementwise mul, add, sub, div and sqrt in fp32, which round the same in torch's
vector body and scalar tail (no fused multiply-add: torch's `alpha=` and addcmul forms are
avoided), and the two norms are numpy's pairwise sum of float64 squares (fp32 squares are exact
in float64), which does not depend on threads; the scalars (bias corrections, lr * trust)
are Python doubles, rounded to fp32 where they meet a tensor.

The norms are of the whole parameter, so LAMB asks for whole parameters: the plan never cuts
one across shards (`whole_params`). State: m and v (exp_avg, exp_avg_sq), fp32 only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ps_offload.optimizers.base import AdamMoments, OptimizerConfig, ShardState, StepCall, check_config
from ps_offload.optimizers.fused import probe_draws, widened
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ParamLayout, ShardSlice, segments_of


@dataclass(frozen=True)
class LAMB(OptimizerConfig):
    """LAMB (layer-wise adaptive moments), run on the daemons over whole parameters."""

    lr: float = 1e-3
    """Learning rate of the first step; `opt.lr = value` between steps follows a schedule."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates."""
    eps: float = 1e-6
    """Added to the square root of the second moment, for numerical stability."""
    weight_decay: float = 1e-2
    """Decoupled weight decay, part of the update the trust ratio scales."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        check_config(self, at_least_zero=("lr", "weight_decay"), positive=("eps",))


def norm(tensor: torch.Tensor) -> float:
    """||tensor||: numpy's pairwise sum of the float64 squares (thread-independent), its root."""
    wide = tensor.detach().reshape(-1).to(torch.float64).numpy()
    return math.sqrt(float(np.square(wide).sum()))


def lamb_step_(
    param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float,
) -> None:  # fmt: skip
    """One LAMB step of one whole parameter in place (the module docstring's lines, in order)."""
    m.mul_(beta1).add_(grad * (1 - beta1))
    v.mul_(beta2).add_(grad * grad * (1 - beta2))
    update = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
    if weight_decay:
        update = update + param * weight_decay
    w_norm, u_norm = norm(param), norm(update)
    trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
    param.sub_(update * (lr * trust))


class LAMBPlugin(AdamMoments):
    name = "lamb"
    config_type = LAMB
    whole_params = True

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
        m, v = shard.state
        step = int(shard.step.item())
        for _, segments, settings in calls:
            for seg in segments:
                if seg.numel != seg.param_numel:  # the plan keeps parameters whole (whole_params)
                    raise RuntimeError(f"LAMB got {seg.numel} of a parameter's {seg.param_numel} elements")
                piece = slice(seg.shard_start, seg.shard_start + seg.numel)
                lamb_step_(
                    master[piece], grad[piece], m[piece], v[piece], step=step, lr=settings.lr, beta1=settings.beta1,
                    beta2=settings.beta2, eps=settings.eps, weight_decay=settings.weight_decay,
                )  # fmt: skip
        if out is not None:
            out.copy_(master)  # rounds as Tensor.to

    def probe(self) -> bytes:
        """LAMB with weight decay, 3 steps over body and tail lengths."""
        draw = probe_draws()
        params = draw()
        m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        for step in range(1, 4):
            for p, g, m_, v_ in zip(params, draw(1e-2), m, v, strict=True):
                lamb_step_(p, g, m_, v_, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.1)
        return b"".join(t.numpy().tobytes() for t in (*params, *m, *v))

    def recompute(
        self,
        config: LAMB,
        shard: ShardSlice,
        layouts: list[ParamLayout],
        group_of: list[int],
        before: list[torch.Tensor],
        grad: torch.Tensor,
        step: int,
        groups: list[ps_pb2.GroupHyperparams],
        state_dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        """The module docstring's step on copies of each whole parameter, shaped as the model's
        (the daemon steps flat views of its arena)."""
        after = [t.clone() for t in before]
        master, m, v = after
        for seg in segments_of(shard, layouts):
            layout, settings = layouts[seg.param_index], groups[group_of[seg.param_index]]
            piece = slice(seg.shard_start, seg.shard_start + seg.numel)
            shaped = [t[piece].clone().view(layout.shape) for t in (master, grad, m, v)]
            lamb_step_(*shaped, step=step + 1, lr=settings.lr, beta1=settings.beta1, beta2=settings.beta2,
                       eps=settings.eps, weight_decay=settings.weight_decay)  # fmt: skip
            for target, source in zip((master, m, v), (shaped[0], shaped[2], shaped[3]), strict=True):
                target[piece] = source.reshape(-1)
        return after


PLUGIN = LAMBPlugin()
