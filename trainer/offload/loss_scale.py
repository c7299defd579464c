"""Dynamic loss scaling for float16 parameters, by torch.amp.GradScaler's rules.

torch's GradScaler refuses float16 gradients (it unscales into the gradients themselves, which
fp16 cannot hold); here the gradients stay scaled in fp16 on the trainer and travel so, and
the daemons unscale them in fp32 (PushHeader.grad_multiplier = 1/scale, as GradScaler
multiplies by its fp32 inverse) before the update. A power-of-two scale makes the unscaling
exact either way.

An inf or a NaN anywhere in a step's gradients, on any rank of the job, skips the step on
every rank: nobody pushes, no daemon version moves, and the scale backs off. After
`growth_interval` good steps in a row it grows, unless that would overflow fp32.

Device syncs: the scale lives on the host (a Python float) and reaches the device as a
kernel argument, so scaling the loss waits for nothing; the one sync of a step is
`found_inf`, whose answer the host needs before it pushes anything.
"""

from __future__ import annotations

import torch

from ps_offload.trainer.config import LossScaling

FLOAT32_MAX = torch.finfo(torch.float32).max


class LossScaler:
    def __init__(self, config: LossScaling) -> None:
        self.config = config
        self.scale = float(torch.tensor(config.init_scale, dtype=torch.float32))
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the scale, as GradScaler.scale spells it (an fp32 scale tensor). The
        scale is a 0-d CPU tensor, which torch passes to a device kernel as a scalar: a copy
        of it to the device would wait for the device's queued work (a pageable copy syncs
        the stream), every step."""
        return loss * torch.tensor(self.scale, dtype=torch.float32)

    @property
    def grad_multiplier(self) -> float:
        """1/scale in fp32, what the daemons multiply the decoded gradient by."""
        return float(torch.tensor(self.scale, dtype=torch.float64).reciprocal().float())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.config.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.config.growth_interval:
            grown = self.scale * self.config.growth_factor
            if grown <= FLOAT32_MAX:
                self.scale = grown
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def found_inf(grads: torch.Tensor) -> bool:
    """Whether any gradient element is inf or NaN (one device sync)."""
    return not bool(torch.isfinite(grads).all())
