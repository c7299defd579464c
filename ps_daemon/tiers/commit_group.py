"""Group commit for one model's file: the commits waiting while one group is written go
to disk together as the next group.

Why. A step's pushes reach a daemon several at a time (a trainer's streams, its ranks) and
each is acknowledged only once its new version is durable: bytes, fdatasync, header,
fdatasync (ps_offload.daemon.tiers.nvme). Run one by one, each commit drains the disk's queue and
pays two flushes; run side by side, their flushes rarely line up (one commit's bytes are
still being written when another's flush starts, so each needs a flush of its own). Grouped,
the arenas of every commit in the group are queued at once (as deep as the I/O threads go),
then one fdatasync covers all their bytes, then their headers, then one fdatasync covers
those: two flushes per group, whatever its size.

How. The first commit to arrive while no group is being written leads: it takes every commit
queued so far (itself included) and writes them as one group; commits arriving meanwhile
queue, and when the group is done the first of them to wake leads the next. Each commit has
taken its slot before it queues (so a group never waits for a slot that only its own end
would free), and a group is at most the spare slots a file has.

What a crash leaves is what one commit's crash leaves, for each commit of the group: every
header is written only after the flush that covers every arena of the group, and no commit is
acknowledged before the flush that covers its header. Recovery is unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ps_offload.daemon.tiers.slot_header import SlotHeader


@dataclass
class PendingCommit:
    """One shard's new version, its slot taken, waiting to be written with its group."""

    shard_id: int
    slot: int
    arena: memoryview
    version: int
    initialized: bool
    numel: int
    header: SlotHeader | None = None  # once its arena is written (its checksums known)
    error: BaseException | None = None
    header_written: bool = False  # its header may be on disk: the slot is not given back on failure
    committed: bool = False  # durable, its slot the shard's: it may be acknowledged
    done: bool = field(default=False, repr=False)


class CommitGroups:
    """The queue of one file's commits, and which one leads the group being written."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[PendingCommit] = []
        self._leading = False
        self.groups = 0  # groups written (stats, tests)
        self.commits = 0  # commits in them

    def run(self, commit: PendingCommit, write_group: Callable[[list[PendingCommit]], None]) -> None:
        """Returns once `commit` was written with its group; raises its error if it failed.
        `write_group(group)` sets each commit's `committed` or its `error`; a commit it left
        with neither (it raised midway) fails with what it raised."""
        with self._cond:
            self._queue.append(commit)
            while not commit.done:
                if self._leading:
                    self._cond.wait()
                    continue
                self._leading = True
                group, self._queue = self._queue, []
                self._cond.release()
                failure: BaseException | None = None
                try:
                    write_group(group)
                except BaseException as exc:  # noqa: BLE001 - given to every commit of the group
                    failure = exc
                finally:
                    self._cond.acquire()
                    for pending in group:
                        if not pending.committed and pending.error is None:
                            pending.error = failure or RuntimeError("the group commit ended without writing it")
                        pending.done = True
                    self.groups += 1
                    self.commits += len(group)
                    self._leading = False
                    self._cond.notify_all()
        if not commit.committed:
            raise commit.error
