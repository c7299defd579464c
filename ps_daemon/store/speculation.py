"""Steps applied while the trainer's backward still runs, exactly (PushHeader.speculate).

With `push_in_backward` a trainer sends each shard's gradient as part 0 of its step as soon
as backward has produced it, and the step's settings only at `step()` (its APPLY): a clip
coefficient, an fp16 overflow or a changed lr are known only after backward. A part sent
with `speculate` carries the settings the trainer expects then. The daemon copies the
shard's arena into a spare one and steps the copy with the held part and those settings,
while backward goes on; the shard itself, its version and every pull stay at the old step.
The APPLY then either names the same settings, and the stepped copy becomes the shard's arena
(a swap: no second pass), or it names others (the clip fired, the lr moved), and the copy is
dropped and the step computed from the held part as without speculation. Both are the same
kernel on the same inputs, so the result is the same, bit for bit; what speculation changes is
when the work is done. This is SuperOffload's speculation-then-validation, with a redo from
the untouched pre-step state instead of an inverse update (which would not be exact).

What a speculation costs: a copy of the shard's arena (master and optimizer state) per step,
and that much memory per shard in flight, bounded by store.speculation_bytes (SpareArenas). A
part that finds no room is held as before and applied by its APPLY. A swap keeps the number
of arenas: the shard's old one becomes the next spare.

A speculation is for one (shard, step, held part): a second part, a GRADIENT push, any other
write, or a step applied otherwise discards it (ps_offload.daemon.store.accumulate). It lives
in RAM only: a restart loses it with the held part, and the trainer pushes again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from ps_offload.daemon.store.push import PushRequest

log = logging.getLogger(__name__)

Arena = tuple[torch.Tensor, memoryview | None]  # the arena tensor, and its O_DIRECT view


def settings_of(push: PushRequest) -> tuple:
    """What of a push decides a step's result besides the gradient and the state: the groups,
    the lr (read only without groups), and the multiplier as the fp32 number the step uses
    (unset is 1: x * 1.0 is x in fp32)."""
    multiplier = 1.0 if push.grad_multiplier is None else float(torch.tensor(push.grad_multiplier, dtype=torch.float32))
    return push.groups, None if push.groups else push.lr, multiplier


class SpareArenas:
    """The arenas speculative steps write into, at most `budget` bytes of them (made on first
    use, then reused: a committed speculation hands the shard's old arena back as a spare),
    and the counts ps-admin stats shows."""

    def __init__(self, budget: int, allocate) -> None:
        """`allocate(nbytes)`: an arena as the tiers make them (page-aligned, with its view)."""
        self.budget = budget
        self._allocate = allocate
        self._lock = threading.Lock()
        self._free: dict[int, list[Arena]] = {}
        self.bytes = 0  # of spares made (held by speculations, or free)
        self.committed = 0
        self.discarded = 0

    def take(self, nbytes: int) -> Arena | None:
        """A spare of `nbytes`, or None when the budget has no room for one."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            if self.bytes + nbytes > self.budget:
                return None
            self.bytes += nbytes
        return self._allocate(nbytes)

    def give(self, arena: Arena, nbytes: int, *, outcome: str = "") -> None:
        """Takes a spare back; `outcome` "adopted" or "discarded" counts the speculation it
        ends (none: a step that failed before it was one)."""
        with self._lock:
            self._free.setdefault(nbytes, []).append(arena)
            if outcome == "adopted":
                self.committed += 1
            elif outcome == "discarded":
                self.discarded += 1

    def trim(self) -> None:
        """Frees the spares no speculation holds (a model was dropped)."""
        with self._lock:
            for size, free in self._free.items():
                self.bytes -= size * len(free)
            self._free.clear()


@dataclass
class Speculation:
    """One shard's step computed ahead: `arena` holds its new master and state."""

    step: int
    settings: tuple
    arena: Arena
    nbytes: int
    seconds: float
    spares: SpareArenas

    def matches(self, push: PushRequest) -> bool:
        """Whether `push` (an APPLY of one part) would compute what this holds."""
        return push.step == self.step and push.parts == 1 and settings_of(push) == self.settings

    def discard(self) -> None:
        self.spares.give(self.arena, self.nbytes, outcome="discarded")


def speculate(shard, push: PushRequest, spares: SpareArenas) -> Speculation | None:
    """Under the shard's write hold and its parts' lock, the shard resident and its part 0 of
    push.step held: steps a copy of the shard with that part and the push's settings. None
    (nothing changed) when no spare is free or the step fails; the APPLY then computes it."""
    parts = shard.parts
    if not shard.initialized or shard.version != push.step or parts.held_for(push.step) != 1:
        return None
    spare = spares.take(shard.arena_bytes)
    if spare is None:
        return None
    started = time.perf_counter()
    arena = (shard.arena, shard.io_view)
    try:
        spare[0].copy_(arena[0])
        shard.attach(spare)
        lr = shard.optimizer.config.lr if push.lr is None else push.lr
        shard.optimizer.apply(shard.master, parts.values, lr, push.groups, multiplier=push.grad_multiplier)
    except Exception:  # the same step runs again at the APPLY, and fails there with its error
        log.warning("speculative step of shard %d step %d failed; left to its APPLY", push.shard_id, push.step,
                    exc_info=True)  # fmt: skip
        spares.give(spare, shard.arena_bytes)
        return None
    finally:  # the shard as it was: its own arena, its step count
        shard.attach(arena)
        shard.optimizer.step.fill_(shard.version)
    return Speculation(push.step, settings_of(push), spare, shard.arena_bytes, time.perf_counter() - started, spares)


def adopt(shard, speculation: Speculation, pull_into: torch.Tensor | None) -> float:
    """Under the shard's write hold: the speculation's arena becomes the shard's, at the next
    version (the caller commits it); the old arena becomes a spare. `pull_into` gets the new
    master values as a pull would round them. Returns the seconds of optimizer work."""
    started = time.perf_counter()
    old = (shard.arena, shard.io_view)
    shard.attach(speculation.arena)
    shard.version += 1
    shard.optimizer.step.fill_(shard.version)
    if pull_into is not None:
        pull_into.copy_(shard.master)  # rounds as Tensor.to, as the step's own `out` does
    speculation.spares.give(old, speculation.nbytes, outcome="adopted")
    return speculation.seconds + time.perf_counter() - started
