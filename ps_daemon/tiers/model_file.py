"""One model's arena file under nvme_dir (the layout and commit protocol are in
ps_offload.daemon.tiers.nvme's docstring): its slots, which slot holds each shard's committed version,
which are free, and which a snapshot pins (ps_offload.daemon.tiers.snapshot_pins)."""

from __future__ import annotations

import os
import threading
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ps_offload.daemon.tiers.commit_group import CommitGroups
from ps_offload.daemon.tiers.group_sync import GroupSync
from ps_offload.daemon.tiers.slot_header import SlotHeader
from ps_offload.daemon.tiers.snapshot_pins import SnapshotBook
from ps_offload.daemon.tiers.tier import PAGE, NoFreeSlot, round_up
from ps_offload.daemon.tiers.version_floors import VersionFloors


@dataclass(frozen=True)
class FileLayout:
    """Where a model's slots are: `slots` of `slot_bytes` each, from offset 0."""

    slot_bytes: int
    slots: int

    @classmethod
    def for_shards(cls, arena_bytes: dict[int, int], *, spare_slots: int) -> FileLayout:
        largest = max(arena_bytes.values(), default=0)
        return cls(PAGE + round_up(largest), len(arena_bytes) + min(spare_slots, len(arena_bytes)))

    @property
    def size(self) -> int:
        return self.slot_bytes * self.slots


class ModelFile:
    """One model's arena file: which slot holds each shard's committed version, and which
    slots are free. `active` and `free` change under `cond`."""

    def __init__(
        self,
        directory: Path,
        model: str,
        layout: FileLayout,
        *,
        create: bool,
        on_flush: Callable[[float], None] | None = None,
    ) -> None:
        self.path = directory / f"{urllib.parse.quote(model, safe='')}.arena"  # (NvmeFiles.arena_path)
        self.floors = VersionFloors(self.path.with_suffix(".versions"))  # read by NvmeFiles.open_model
        self.snapshots = SnapshotBook(self.path.with_suffix(".snapshots"))  # read there too
        self.layout = layout
        self.active: dict[int, tuple[int, SlotHeader]] = {}  # shard -> (slot, header)
        self.free: deque[int] = deque(range(layout.slots))
        self.cond = threading.Condition()
        self.dropped = False  # set (under cond) when the model is dropped: its waiters end
        # A new file is truncated: a stale file of the same name (a crash between creating it
        # and recording the spec) must not lend its old headers to the new model.
        flags = os.O_RDWR | os.O_DIRECT | (os.O_CREAT | os.O_TRUNC if create else 0)
        self.fd = os.open(self.path, flags, 0o600)
        self.flushes = GroupSync(self.fd, on_flush=on_flush)  # commits running at once share fdatasyncs
        self.groups = CommitGroups()  # commits waiting meanwhile are written together (commit_group)
        if create:
            self.floors.remove()  # nor its old floors and snapshots
            self.snapshots.remove_file()
        if create and layout.size:
            try:
                os.posix_fallocate(self.fd, 0, layout.size)  # ENOSPC here, not mid-training
            except OSError:
                os.close(self.fd)
                self.path.unlink(missing_ok=True)
                raise

    def offset(self, slot: int) -> int:
        return slot * self.layout.slot_bytes

    def take_slot(self, timeout: float) -> int:
        with self.cond:
            if not self.cond.wait_for(lambda: self.free, timeout=timeout):
                raise NoFreeSlot(f"no free slot in {self.path.name} for {timeout:.0f}s")
            return self.free.popleft()

    def committed(self, shard_id: int, slot: int, header: SlotHeader) -> None:
        with self.cond:
            previous = self.active.get(shard_id)
            self.active[shard_id] = (slot, header)
            self.snapshots.committed_locked(shard_id, slot, header)
            if previous is not None and not self.snapshots.is_pinned(previous[0]):
                self.free.append(previous[0])
            self.cond.notify_all()  # a commit waiting for a slot, a snapshot waiting for this version

    def release(self, slots: list[int]) -> None:
        """Under cond: slots a deleted snapshot pinned go back to the free list, but not one
        still holding its shard's committed version."""
        active = {slot for slot, _ in self.active.values()}
        self.free.extend(slot for slot in slots if slot not in active)
        self.cond.notify_all()

    def grown(self, layout: FileLayout) -> None:
        """The file now has `layout`'s slots (more than before): the new ones are free."""
        with self.cond:
            self.free.extend(range(self.layout.slots, layout.slots))
            self.layout = layout
            self.cond.notify_all()

    def give_back(self, slot: int) -> None:
        with self.cond:
            self.free.append(slot)
            self.cond.notify()

    def close(self) -> None:
        os.close(self.fd)
