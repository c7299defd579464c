"""The one optimizer interface a PipelineTrainer runs over, and its in-process implementation.

    StepOptimizer    flat (FlatParams), lr, zero_grad(), step(), synchronize(), close()
    OffloadOptimizer the daemons apply the update (trainer/offload/whole_model.py)
    LocalOptimizer   torch's fused AdamW / SGD in this process (the baseline the daemons
                     are measured against)

Both keep the parameters and gradients in one FlatParams, so the data-parallel reducer and
gradient clipping work on `flat.grads` whichever runs the update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch import nn

from ps_offload.optimizers import plugin_of
from ps_offload.trainer.config import OptimizerConfig
from ps_offload.trainer.io.flat import FlatParams


@runtime_checkable
class StepOptimizer(Protocol):
    """What a training loop needs of an optimizer whose parameters live in one FlatParams."""

    flat: FlatParams
    """The parameters and their gradients, as views into two flat buffers."""

    lr: float
    """The learning rate of the next step(); set it between steps to follow a schedule."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim's; with set_to_none=False every `.grad` points into `flat.grads`,
        zeroed (no copy at the next step)."""

    def step(self) -> None:
        """Applies `flat.grads` to the parameters."""

    def synchronize(self) -> None:
        """Returns once the parameters hold the last step's result (before reading them
        outside a forward pass: evaluation, saving)."""

    def close(self) -> None:
        """Releases what the optimizer holds (threads, connections)."""


class LocalOptimizer:
    """torch.optim.AdamW / SGD (fused) over a module's trainable parameters, in process."""

    def __init__(
        self,
        module: nn.Module,
        *,
        optimizer: OptimizerConfig,
        no_weight_decay: Callable[[str, nn.Parameter], bool] | None = None,
    ) -> None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.flat = FlatParams(named)
        skip = [bool(no_weight_decay and no_weight_decay(n, p)) for n, p in named]
        groups = [{"params": [p for (_, p), s in zip(named, skip, strict=True) if not s],
                   "weight_decay": optimizer.weight_decay}]  # fmt: skip
        if any(skip):
            groups.append({"params": [p for (_, p), s in zip(named, skip, strict=True) if s], "weight_decay": 0.0})
        self.torch_optimizer = plugin_of(optimizer).torch_optimizer(optimizer, groups)

    @property
    def lr(self) -> float:
        return self.torch_optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.torch_optimizer.param_groups:
            group["lr"] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.flat.zero_grads(set_to_none)

    def step(self) -> None:
        self.flat.adopt_grads()
        self.torch_optimizer.step()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass
