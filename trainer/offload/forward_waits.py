"""Which of the step's pulls each module's forward waits for before it runs.

After `step()` the new parameters arrive shard by shard while the next forward already runs:
a module's forward pre-hook waits only for the shards its parameters lie in, so the first
layers compute while the last are still on the wire.

[Note: parameters read by another module's forward] A module's parameters are not always read
in its own forward. `nn.MultiheadAttention` passes `out_proj.weight` and `out_proj.bias` to
`F.multi_head_attention_forward` and never calls `out_proj`; a model may use
`self.head.weight` in its root forward; an inference fast path may read every child's
parameters in its parent's forward, in eval only (torch turns its own TransformerEncoderLayer
fast path off when a module has hooks, as here; others need not). Waiting at the owner's hook
then waits too late, or never: the forward reads the shard's previous values while its pull
is in flight, the gradient of that step is silently wrong, and the daemons apply it (issue
39: a small `nn.TransformerEncoder`, one update in a run wrong on every replica).

So the waits are learned per forward *kind*: the outermost module called (the model, or a
block re-run by activation checkpointing), its `training` flag and whether grad is enabled,
which together decide such fast paths. The first forward of a kind waits for every pending
pull before it starts (it cannot go wrong, and overlaps nothing) and records which modules'
forwards ran. Each parameter whose owner did not run is then waited for by the nearest
enclosing module that did (the attention for its `out_proj`, the parent on a fast path, the
outermost module for a root-level read), and every later forward of that kind waits by that
map. A module that runs in a later forward but did not in the first still waits for its own
shards. What stays outside: a parameter read through a reference outside the module tree
(a Python attribute that is not a registered submodule or parameter) in a forward of a kind
whose first forward read it too; `opt.synchronize()` before such code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

Key = tuple[int, bool, bool]  # (outermost module's id, its training flag, grad enabled)
_FAILED = -1  # in a learning forward's set of modules run: it raised


class ForwardWaits:
    """Pre- and post-hooks on `model`'s modules (those that own offloaded parameters or
    enclose one) that call `wait(shard_ids)` before each module's forward, as learned above;
    `wait_all()` before the first forward of each kind."""

    def __init__(
        self,
        model: nn.Module,
        own: dict[nn.Module, list[int]],
        *,
        wait: Callable[[list[int]], None],
        wait_all: Callable[[], None],
    ) -> None:
        """`own`: each module's own (recurse=False) parameters' shard ids, for the modules
        that have any."""
        self._own = {id(m): ids for m, ids in own.items() if ids}
        self._wait = wait
        self._wait_all = wait_all
        self._parent: dict[int, int] = {}
        self._children: dict[int, list[nn.Module]] = {}
        encloses = _enclosing(model, set(self._own))
        for module in model.modules():
            kids = [c for c in module.children() if id(c) in encloses]
            self._children[id(module)] = kids
            for child in kids:
                self._parent.setdefault(id(child), id(module))
        self._maps: dict[Key, dict[int, list[int]]] = {}
        self._stack: list[nn.Module] = []
        self._current: dict[int, list[int]] = {}  # the running forward's waits, once its kind is known
        self._learning: tuple[Key, nn.Module, set[int]] | None = None
        self._hooks = []
        for module in model.modules():
            if id(module) in encloses:
                self._hooks.append(module.register_forward_pre_hook(self._before))
                self._hooks.append(module.register_forward_hook(self._after, always_call=True))

    @property
    def kinds(self) -> int:
        """Forward kinds learned so far."""
        return len(self._maps)

    def _before(self, module: nn.Module, _args: object) -> None:
        if not self._stack:  # the outermost call: a new forward
            key = (id(module), module.training, torch.is_grad_enabled())
            current = self._maps.get(key)
            if current is None:
                self._wait_all()
                self._learning = (key, module, set())
            self._current = current or {}
        self._stack.append(module)
        if self._learning is not None:
            self._learning[2].add(id(module))
            return
        ids = self._current.get(id(module))
        if ids is None:
            ids = self._own.get(id(module))
        if ids:
            self._wait(ids)

    def _after(self, module: nn.Module, _args: object, output: object) -> None:
        if not self._stack or self._stack[-1] is not module:
            self._stack.clear()  # a hook that did not run (an exception past torch's guard): start afresh
            self._learning = None
            return
        self._stack.pop()
        if self._learning is not None and output is None and sys.exc_info()[0] is not None:
            self._learning[2].add(_FAILED)  # raised (torch calls always_call hooks from its except)
        if not self._stack and self._learning is not None:
            key, outermost, ran = self._learning
            if _FAILED not in ran:  # a forward cut short shows too few modules run: learn from the next
                self._maps[key] = self._learned(outermost, ran)
            self._learning = None

    def _learned(self, outermost: nn.Module, ran: set[int]) -> dict[int, list[int]]:
        """Per module that ran, the shards it waits for: its own, and those of the modules
        below it that did not run, down to the next that did."""
        waits: dict[int, list[int]] = {}
        pending = [(outermost, id(outermost))]
        while pending:
            module, waiter = pending.pop()
            if id(module) in ran:
                waiter = id(module)
            own = self._own.get(id(module))
            if own:
                waits.setdefault(waiter, []).extend(own)
            pending.extend((child, waiter) for child in self._children.get(id(module), []))
        return {m: sorted(set(ids)) for m, ids in waits.items()}

    def forget(self) -> None:
        """Learns every kind afresh (the model's tensors were adopted anew)."""
        self._maps.clear()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _enclosing(model: nn.Module, owners: set[int]) -> set[int]:
    """The ids of the modules that own an offloaded parameter or have a descendant that does."""
    found: set[int] = set()

    def visit(module: nn.Module) -> bool:
        inside = id(module) in owners
        for child in module.children():
            inside = visit(child) or inside
        if inside:
            found.add(id(module))
        return inside

    visit(model)
    return found
