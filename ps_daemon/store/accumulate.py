"""A step's gradient pushed in parts (GRADIENT_PART pushes, then APPLY; proto/ps.proto): per
shard, the fp32 sum of the parts received so far, until APPLY steps the optimizer with it.

A trainer pushes a shard's gradient as soon as backward has produced it, or once per backward
pass when it accumulates several, and applies the step when it knows the step's settings
(APPLY's groups, lr and grad_multiplier: a clip or the loss scale). Part 0 widens its payload
(RAW, BF16 or FP16; exact) into an fp32 accumulator, a copy over every value rather than an add
to zeros, so that one part and its APPLY are bit-identical to a GRADIENT push of that payload.
Part i > 0 is widened into a buffer of its own and added, `acc += part` in fp32, and only as
the next part: the sum is ((p0 + p1) + p2) + ... whatever order the parts' pushes raced in.

Invariants (one GradientParts per shard, changed only under its `lock`): `values` holds the
sum of parts 0..held-1 of `step` (fp32, the shard's numel), or is None with held 0. It is for
the shard's step in progress: an update of the shard (APPLY's, a GRADIENT push's, which
replaces the parts, or a MOMENTUM push's) ends an accumulator of an older step once the update
is committed, and a part 0 finding one of another step starts over. An ended accumulator's
memory is kept (`kept`) for the next step's part 0 to write over, so a trainer pushing parts
every step costs the kernel no fresh pages each step; an update that applies no parts frees it.
So a daemon holds at most one accumulator per shard, in use or kept. Without an NVMe tier it
lives in RAM, beside the shard's arena: counted in the store's ram_bytes_used (kept or not) but
not bounded by the RAM tier's budget. With one, it is a file-backed mapping on the NVMe tier
(ps_daemon/tiers/accumulator_files.py: the kernel pages it out under memory pressure), so sums
as large as a model larger than RAM fit. Either way it is kept while the shard is evicted to
NVMe (a part needs neither the shard's values nor its residency), and lost on a restart (APPLY
then answers that no parts are held, and the trainer sends them again).

A part 0 sent with `speculate` may also have been stepped ahead into a spare arena
(`speculation`, ps_offload.daemon.store.speculation): it is for the sum as it is, so anything
that changes or drops the sum discards it first.

Locks: `lock` is taken inside the shard's write hold (an update) and never while holding
shard.cond. A part takes only `lock`; APPLY holds it from the count check to the commit, so no
part slips in between, and a failed update or commit keeps the parts for a retry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from ps_offload.daemon.errors import FailedPrecondition
from ps_offload.daemon.store.push import PushRequest, PushResult, Shard, check_step_locked
from ps_offload.daemon.store.speculation import Speculation
from ps_offload.daemon.tiers.tier import RAM_SUMS, SumStore


class GradientParts:
    """One shard's accumulator for the step being pushed in parts (the module docstring)."""

    def __init__(self, sums: SumStore = RAM_SUMS) -> None:
        """`sums`: where a sum is made (file-backed on the NVMe tier: AccumulatorFiles)."""
        self.lock = threading.Lock()
        self.step = 0
        self.held = 0
        self.values: torch.Tensor | None = None
        self.speculation: Speculation | None = None  # the step computed ahead from `values`
        # The last applied step's sum, kept for the next step's part 0 to write over (new_sum):
        # a fresh one would be new pages, each faulted in and zeroed by the kernel every step
        # (a 64 MiB shard's sum is mmapped by malloc, 16384 faults). Freed by an update that
        # applies no parts (the trainer stopped pushing parts) and when the model goes.
        self.kept: torch.Tensor | None = None
        self._sums = sums

    @property
    def in_ram(self) -> bool:
        return self._sums.in_ram

    def new_sum(self, numel: int) -> torch.Tensor:
        """Room for a step's sum (part 0 is widened into it, over every value): the kept one
        when there is one, else a new one."""
        with self.lock:
            kept, self.kept = self.kept, None
        return kept if kept is not None and kept.numel() == numel else self._sums.allocate(numel)

    @property
    def nbytes(self) -> int:
        """The bytes of the sum held and of the one kept (read without the lock: a figure)."""
        return sum(t.numel() * t.element_size() for t in (self.values, self.kept) if t is not None)

    def release_locked(self) -> int:
        """Under `lock`: frees the sum (and its step computed ahead) and the kept one; returns
        their bytes."""
        self.discard_speculation_locked()
        freed = self.nbytes
        self.values, self.held, self.kept = None, 0, None
        return freed

    def held_for(self, step: int) -> int:
        """Parts of `step` held (under `lock`)."""
        return self.held if self.values is not None and self.step == step else 0

    def check(self, push: PushRequest, version: int) -> PushResult | None:
        """Before a GRADIENT_PART's payload is read, or before an APPLY (the shard at version
        push.step): the acknowledgement of a part held already, None for one to apply now;
        raises for a part out of order or an APPLY of another number of parts. Checked again
        when applied."""
        with self.lock:
            if push.kind == "apply":
                self.check_count_locked(push)
                return None
            return self.check_place_locked(push, version)

    def check_place_locked(self, push: PushRequest, version: int) -> PushResult | None:
        held = self.held_for(push.step)
        if push.part < held:  # resent after a lost answer: added once only
            return PushResult(applied=False, version=version)
        if push.part > held:
            expected = f"part {held} (parts 0..{held - 1} are held)" if held else "part 0"
            raise FailedPrecondition(
                f"{push.where}: part {push.part} of step {push.step} is out of order; the daemon expects {expected}. "
                "Parts are added in order, each once"
            )
        return None

    def check_count_locked(self, push: PushRequest) -> None:
        held = self.held_for(push.step)
        if held != push.parts:
            why = " (none: they were not pushed, or the daemon restarted since; push them again)" if not held else ""
            raise FailedPrecondition(
                f"{push.where}: APPLY of step {push.step} names {push.parts} parts, the daemon holds {held} parts "
                f"of that step{why}"
            )

    def gradient_locked(self, push: PushRequest) -> tuple[torch.Tensor, float | None]:
        """Under `lock` and the shard's write hold: the fp32 sum an APPLY steps with, and its
        grad_multiplier (applied in the step, as a GRADIENT push's is). The sum itself stays
        until the update is committed (drop_applied_locked). Raises unless exactly push.parts
        parts of push.step are held."""
        self.check_count_locked(push)
        return self.values, push.grad_multiplier

    def drop_applied_locked(self, version: int) -> None:
        """Under `lock`, once an update to `version` is committed: an accumulator of a step now
        applied is done (kept for the next step's part 0), and a speculation of one is
        discarded. An update that applied no parts frees the kept one: parts have stopped."""
        if self.speculation is not None and self.speculation.step < version:
            self.discard_speculation_locked()
        if self.values is not None and self.step < version:
            self.kept, self.values, self.held = self.values, None, 0
        elif self.values is None:
            self.kept = None

    def discard_speculation_locked(self) -> None:
        """Under `lock`: the step computed ahead is not to be used (its spare goes back)."""
        if self.speculation is not None:
            self.speculation.discard()
            self.speculation = None

    def claim_speculation_locked(self, push: PushRequest) -> Speculation | None:
        """Under `lock` and the shard's write hold, for an APPLY about to step: the step
        computed ahead if it is what this APPLY would compute (ps_offload.daemon.store.
        speculation); else None, and one computed with other settings is discarded."""
        speculation, self.speculation = self.speculation, None
        if speculation is not None and speculation.matches(push) and self.held_for(push.step) == 1:
            return speculation
        if speculation is not None:
            speculation.discard()
        return None


class PartsShard(Shard, Protocol):
    parts: GradientParts


def add_part(shard: PartsShard, push: PushRequest, borrow: Callable[[], torch.Tensor]) -> PushResult:
    """Adds a GRADIENT_PART (its payload parsed, push.check_shard passed) to `shard`'s
    accumulator. Acknowledges without effect a part held already, or one of a step applied
    already; raises, changing nothing, for one that cannot be added (a step ahead of the
    shard, a part out of order)."""
    parts = shard.parts
    # Widened outside the lock: the payload and these buffers are this push's own.
    if push.part == 0:
        values = _widened(push, parts.new_sum(shard.slice.numel))
    else:
        values = push.values(borrow)  # RAW as sent; BF16 and FP16 widened into a buffer
    with parts.lock:
        ack = check_step_locked(shard, push) or parts.check_place_locked(push, shard.version)
        if ack is not None:
            return ack
        parts.discard_speculation_locked()  # computed from the sum this part replaces or adds to
        if push.part == 0:  # starts the step's sum, or starts over on another step's
            parts.step, parts.held, parts.values = push.step, 1, values
        else:
            parts.values.add_(values)
            parts.held += 1
        return PushResult(applied=True, version=shard.version)


def _widened(push: PushRequest, out: torch.Tensor) -> torch.Tensor:
    """The part's values in `out`, fp32: copied (RAW) or widened exactly (BF16, FP16)."""
    data = push.data
    return out.copy_(data) if isinstance(data, torch.Tensor) else data.decompress(out)
