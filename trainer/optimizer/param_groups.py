"""torch.optim param_groups for an optimizer that the daemons run.

The trainer's optimizer is a torch.optim.Optimizer, so a torch LR scheduler, Hugging Face's
Trainer or a user's own code change `param_groups[i]["lr"]` (or betas, eps, weight_decay,
momentum) between steps, as they would for torch.optim.AdamW. Every GRADIENT push carries all
groups' values of that step (PushHeader.groups); each parameter is registered with its group
index (ParamSpec.group), and the daemon steps each parameter with its group's values.

What the daemons cannot follow is refused at the step that would need it, before any push:
a group added or a parameter moved between groups (the registration fixed the grouping), or a
setting the daemons' kernels do not have (amsgrad, maximize, a change of nesterov).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ps_offload.proto import ps_pb2
from ps_offload.trainer.config import AdamW, OptimizerConfig

ADAMW_SETTINGS = ("lr", "betas", "eps", "weight_decay")
SGD_SETTINGS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
# Settings of torch's own optimizers that a user may copy over; the daemons run only the
# default. (name, the value the daemons run)
UNSUPPORTED = (("amsgrad", False), ("maximize", False))


def defaults_of(optimizer: OptimizerConfig) -> dict:
    """torch.optim's `defaults` for the optimizer the daemons run."""
    if isinstance(optimizer, AdamW):
        return {"lr": optimizer.lr, "betas": tuple(optimizer.betas), "eps": optimizer.eps,
                "weight_decay": optimizer.weight_decay}  # fmt: skip
    return {"lr": optimizer.lr, "momentum": optimizer.momentum, "dampening": optimizer.dampening,
            "weight_decay": optimizer.weight_decay, "nesterov": optimizer.nesterov}  # fmt: skip


def initial_groups(
    named: list[tuple[str, nn.Parameter]], no_weight_decay: Callable[[str, nn.Parameter], bool] | None
) -> tuple[list[dict], list[int]]:
    """The param groups (group 0: weight decay as configured; group 1, when `no_weight_decay`
    picks any parameter: weight_decay 0) and each parameter's group index, in `named` order."""
    index = [1 if no_weight_decay is not None and no_weight_decay(n, p) else 0 for n, p in named]
    groups = [{"params": [p for (_, p), g in zip(named, index, strict=True) if g == 0]}]
    if any(index):
        groups.append({"params": [p for (_, p), g in zip(named, index, strict=True) if g == 1], "weight_decay": 0.0})
    if not groups[0]["params"]:  # every parameter without decay: one group
        groups = [{"params": groups[1]["params"], "weight_decay": 0.0}]
        index = [0] * len(index)
    return groups, index


class GroupTracker:
    """Checks that param_groups stay something the daemons can follow, and turns them into
    the PushHeader.groups of a step."""

    def __init__(self, param_groups: list[dict], optimizer: OptimizerConfig) -> None:
        self.adam = isinstance(optimizer, AdamW)
        self.members = [[id(p) for p in group["params"]] for group in param_groups]
        self.nesterov = None if self.adam else [group["nesterov"] for group in param_groups]

    def follow(self, param_groups: list[dict]) -> None:
        """Takes the groups' parameters as they are now: the optimizer adopted the model's new
        tensors for the registered ones (ps_offload.trainer.optimizer.param_binding), one for one."""
        self.members = [[id(p) for p in group["params"]] for group in param_groups]

    def hyperparams(self, param_groups: list[dict]) -> list[ps_pb2.GroupHyperparams]:
        """This step's settings of every group, after checking the daemons can apply them."""
        if len(param_groups) != len(self.members):
            raise ValueError(
                f"the optimizer has {len(param_groups)} param groups, the daemons were registered with "
                f"{len(self.members)}: groups cannot be added after offload() (pass them to it instead)"
            )
        out = []
        for index, group in enumerate(param_groups):
            if [id(p) for p in group["params"]] != self.members[index]:
                raise ValueError(f"param group {index} holds other parameters than at registration")
            for name, supported in UNSUPPORTED:
                if group.get(name, supported) != supported:
                    raise ValueError(f"param group {index}: {name}={group[name]!r} is not run by the daemons")
            if not self.adam and group["nesterov"] != self.nesterov[index]:
                raise ValueError(f"param group {index}: nesterov cannot change after registration")
            out.append(self._one(index, group))
        return out

    def _one(self, index: int, group: dict) -> ps_pb2.GroupHyperparams:
        values = {"lr": _number(group["lr"]), "weight_decay": _number(group["weight_decay"])}
        if self.adam:
            beta1, beta2 = group["betas"]
            values.update(beta1=_number(beta1), beta2=_number(beta2), eps=_number(group["eps"]))
        else:
            values.update(momentum=_number(group["momentum"]), dampening=_number(group["dampening"]))
        for name, value in values.items():
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"param group {index}: {name} must be finite and >= 0, got {value!r}")
        return ps_pb2.GroupHyperparams(**values)


def _number(value: float | torch.Tensor) -> float:
    """torch.optim allows a tensor lr (and betas); the wire takes a double."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
