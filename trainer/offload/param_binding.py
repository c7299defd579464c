"""Is the model still training with the tensors the optimizer updates?

The offload optimizer re-points every parameter's `.data` into its flat buffer
(ps_offload.trainer.io.flat) and pulls each step's new values there. Much of the ecosystem
gives parameters new storage after the optimizer was built: `model.to(device)` and
`.cuda()` (even to the device they are on, as the Hugging Face Trainer does), `.to(dtype)`,
`load_state_dict(..., assign=True)`, wrappers that re-create parameters. The model then
computes with tensors nobody updates while the daemons' versions advance: training that
does nothing, without a word. So every `step()` asks, before anything is pushed:

* is each parameter, under every name the model reaches it by, still the Parameter object
  the optimizer registered (a re-created one is another object), and
* is its storage still the flat buffer's view, on the buffer's device, in its dtype and
  shape (`.to()` keeps the object and swaps `.data`)?

That is a dict lookup and a pointer comparison per name: microseconds for hundreds of
parameters. What the optimizer then does with a change (adopt the new tensors, or refuse
naming the parameter and what changed) is ps_offload.trainer.offload.whole_model's; this module only
finds the changes and says what they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ps_offload.trainer.io.flat import FlatParams


class ParameterChanged(RuntimeError):
    """The model no longer trains with the tensors the optimizer updates, and the optimizer
    cannot take the new ones over (raised by `step()` before anything is pushed)."""


@dataclass(frozen=True)
class Change:
    """What happened to one registered parameter (flat index `index`)."""

    index: int
    name: str
    current: torch.Tensor | None  # what the model holds under `name` now (None: nothing)
    what: str  # in words, for the error or the log

    @property
    def removed(self) -> bool:
        return self.current is None


def _owner(name: str) -> tuple[list[str], str]:
    """`name` ("a.b.weight") split into its module path and attribute."""
    *path, attr = name.split(".")
    return path, attr


class ParamBinding:
    """The names under which `model` reaches each of `flat`'s parameters, and the check that
    each name still leads to that parameter, stored in the flat buffer."""

    def __init__(self, model: nn.Module, names: list[str], flat: FlatParams) -> None:
        self.model = model
        self.names = names
        # Every name of every registered parameter: a tied weight (GPT-2's wte and lm_head)
        # is one parameter under two names, and a re-created model may untie them.
        index_of = {id(p): i for i, p in enumerate(flat.params)}
        self.aliases: list[tuple[int, list[str], str, str]] = []
        for full, p in model.named_parameters(remove_duplicate=False):
            if id(p) in index_of:
                path, attr = _owner(full)
                self.aliases.append((index_of[id(p)], path, attr, full))
        self.bind(flat)

    def bind(self, flat: FlatParams) -> None:
        """Takes `flat` (after an adoption) as what the model must train with."""
        self.flat = flat
        self._expected = [(p, p.data_ptr()) for p in flat.params]
        self._device = flat.values.device
        self._dtype = flat.values.dtype
        self._modules: dict[tuple[str, ...], nn.Module] = {}

    def _lookup(self, path: list[str], attr: str) -> torch.Tensor | None:
        module: nn.Module | None = self.model
        for part in path:
            module = module._modules.get(part) if module is not None else None
        if module is None:
            return None
        return module._parameters.get(attr)

    def changes(self) -> list[Change]:
        """The registered parameters that the model no longer trains with as registered, one
        entry per parameter (its first changed name); empty when all is as it was."""
        found: dict[int, Change] = {}
        for index, path, attr, full in self.aliases:
            if index in found:
                continue
            current = self._lookup(path, attr)
            expected, pointer = self._expected[index]
            if current is expected and current.data_ptr() == pointer:
                continue  # the common case: nothing moved (one `is` and one pointer compare)
            found[index] = Change(index, full, current, self._describe(index, current))
        return [found[i] for i in sorted(found)]

    def _describe(self, index: int, current: torch.Tensor | None) -> str:
        expected, _ = self._expected[index]
        if current is None:
            return "is no longer a parameter of the model"
        what = []
        if current is not expected:
            what.append("is a new Parameter object (re-created: load_state_dict(assign=True), a wrapper)")
        else:
            what.append("has new storage (model.to(), .cuda(), .half() or an assignment to .data)")
        if current.device != self._device:
            what.append(f"moved from {self._device} to {current.device}")
        if current.dtype != self._dtype:
            what.append(f"changed dtype from {self._dtype} to {current.dtype}")
        if tuple(current.shape) != tuple(expected.shape):
            what.append(f"changed shape from {tuple(expected.shape)} to {tuple(current.shape)}")
        return ", ".join(what)

    def current_params(self) -> list[tuple[str, torch.Tensor]]:
        """What the model holds now under each registered parameter's first name, in the flat
        order; raises ParameterChanged naming any that is gone."""
        out = []
        for name in self.names:
            current = self._lookup(*_owner(name))
            if current is None:
                raise ParameterChanged(
                    f"parameter {name!r} is no longer a parameter of the model: the optimizer cannot follow a model "
                    "whose parameters were removed or renamed; build the optimizer after changing the model"
                )
            out.append((name, current))
        return out

    def untied(self) -> list[str]:
        """Names that reached one registered parameter and now reach different tensors."""
        first: dict[int, torch.Tensor | None] = {}
        broken = []
        for index, path, attr, full in self.aliases:
            current = self._lookup(path, attr)
            if index not in first:
                first[index] = current
            elif current is not first[index]:
                broken.append(full)
        return broken
