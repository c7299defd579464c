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

from torch import nn

from ps_offload.optimizers import plugin_of
from ps_offload.proto import ps_pb2
from ps_offload.trainer.config import OptimizerConfig

# Settings of torch's own optimizers that a user may copy over; the daemons run only the
# default. (name, the value the daemons run)
UNSUPPORTED = (("amsgrad", False), ("maximize", False))


def defaults_of(optimizer: OptimizerConfig) -> dict:
    """torch.optim's `defaults` for the optimizer the daemons run."""
    return plugin_of(optimizer).torch_defaults(optimizer)


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
        self.plugin = plugin_of(optimizer)
        self.members = [[id(p) for p in group["params"]] for group in param_groups]
        # Settings fixed at registration (SGD's nesterov), per group.
        self.fixed = [{name: group[name] for name in self.plugin.fixed_settings} for group in param_groups]

    def follow(self, param_groups: list[dict]) -> None:
        """Takes the groups' parameters as they are now: the optimizer adopted the model's new
        tensors for the registered ones (ps_offload.trainer.offload.param_binding), one for one."""
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
            for name, value in self.fixed[index].items():
                if group[name] != value:
                    raise ValueError(f"param group {index}: {name} cannot change after registration")
            out.append(self._one(index, group))
        return out

    def _one(self, index: int, group: dict) -> ps_pb2.GroupHyperparams:
        values = self.plugin.group_settings(group)
        settings = values.pop("settings", {})  # an optimizer's own (GroupHyperparams.settings), checked by it
        for name, value in values.items():
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"param group {index}: {name} must be finite and >= 0, got {value!r}")
        for name, value in settings.items():
            if not math.isfinite(value):
                raise ValueError(f"param group {index}: {name} must be finite, got {value!r}")
        return ps_pb2.GroupHyperparams(**values, settings=settings)
