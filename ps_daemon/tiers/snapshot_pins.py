"""Snapshots on the NVMe tier: every shard of a model at one step, kept by pinning the slots
that hold that version, so a snapshot costs no copy of the state (ps-admin snapshot).

A snapshot at step S pins, for each of this daemon's shards, the slot committed with version
S: at once for a shard already there, at its commit of version S for a shard behind (the
trainers go on; nothing waits for the snapshot). A shard past S has reused that slot, so it
is refused. A pinned slot is never freed by its shard's next commits. To keep the
spare slots free for commits, taking a snapshot first grows the arena file by one slot per
shard (the record is rewritten with the new slot count): the disk holds the state once more
for as long as the snapshot lives, and deleting the snapshot gives its slots back to the file
(which keeps its size).

A snapshot is complete when all its shards are pinned; then, and only then, it is recorded
in `MODEL.snapshots` (JSON: temporary file, fsync, rename) and the caller answered. One that
is not complete when its caller stops waiting is cancelled; at a restart only recorded ones
exist. Recovery checks each recorded slot's header still names the shard at step S (a
damaged one marks the snapshot damaged; its pulls answer DATA_LOSS) and keeps the slots out
of the free list. A multi-daemon snapshot is complete when every daemon's is (ps-admin).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ps_offload.daemon.tiers.slot_header import SlotHeader
from ps_offload.daemon.tiers.tier import SnapshotRefused

FORMAT = 1


@dataclass
class Snapshot:
    name: str
    step: int
    created: float
    pinned: dict[int, tuple[int, SlotHeader | None]] = field(default_factory=dict)  # shard -> (slot, header)
    waiting: set[int] = field(default_factory=set)  # shards not yet at `step`
    damaged: str = ""  # why a recorded snapshot cannot be read back; "" when fine

    @property
    def complete(self) -> bool:
        return not self.waiting


class SnapshotBook:
    """One model's snapshots on this daemon. Read and changed under its ModelFile's cond."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.snapshots: dict[str, Snapshot] = {}
        self.pins: Counter[int] = Counter()  # slot -> snapshots pinning it
        self.save_lock = threading.Lock()  # orders the record's rewrites (each from the state under cond)

    def is_pinned(self, slot: int) -> bool:
        return self.pins[slot] > 0

    def _pin(self, snap: Snapshot, shard_id: int, slot: int, header: SlotHeader | None) -> None:
        snap.pinned[shard_id] = (slot, header)
        self.pins[slot] += 1

    def check_locked(
        self, name: str, step: int, active: dict[int, tuple[int, SlotHeader]], shard_ids: set[int]
    ) -> None:
        """Raises SnapshotRefused unless a snapshot `name` of `shard_ids` at `step` can be
        taken now (`active`: each shard's committed slot and header)."""
        if name in self.snapshots:
            raise SnapshotRefused(f"a snapshot named {name!r} exists already (delete it first, or pick another name)")
        past = {sid: h.version for sid, (_, h) in active.items() if sid in shard_ids and h.version > step}
        if past:
            sid, version = min(past.items())
            raise SnapshotRefused(
                f"{len(past)} shards are past step {step} (shard {sid} is at version {version}), and the slot of their "
                f"version {step} may be reused already; ask for step {max(past.values())} or later"
            )

    def begin_locked(
        self, name: str, step: int, active: dict[int, tuple[int, SlotHeader]], shard_ids: set[int]
    ) -> Snapshot:
        """A new snapshot of `shard_ids` at `step`, pinning the shards already there (`active`:
        each shard's committed slot and header). Raises SnapshotRefused, changing nothing."""
        self.check_locked(name, step, active, shard_ids)
        snap = Snapshot(name, step, time.time())
        for sid in shard_ids:
            found = active.get(sid)
            if found is not None and found[1].version == step:
                self._pin(snap, sid, *found)
            else:
                snap.waiting.add(sid)
        self.snapshots[name] = snap
        return snap

    def committed_locked(self, shard_id: int, slot: int, header: SlotHeader) -> bool:
        """A commit of the shard into `slot`: pins it for each snapshot waiting for that
        version. Returns whether one became complete."""
        completed = False
        for snap in self.snapshots.values():
            if shard_id in snap.waiting and header.version == snap.step:
                snap.waiting.discard(shard_id)
                self._pin(snap, shard_id, slot, header)
                completed |= snap.complete
        return completed

    def remove_locked(self, name: str) -> list[int]:
        """Forgets a snapshot; returns the slots no snapshot pins any more."""
        snap = self.snapshots.pop(name)
        released = []
        for slot, _ in snap.pinned.values():
            self.pins[slot] -= 1
            if self.pins[slot] <= 0:
                del self.pins[slot]
                released.append(slot)
        return released

    def record_locked(self) -> dict:
        """What `write` records: the complete snapshots."""
        recorded = {}
        for name, snap in sorted(self.snapshots.items()):
            if snap.complete:
                slots = {str(shard_id): slot for shard_id, (slot, _) in snap.pinned.items()}
                recorded[name] = {"step": snap.step, "created": snap.created, "slots": slots}
        return recorded

    def write(self, recorded: dict) -> None:
        """Replaces the record (under save_lock, without the cond: it writes and fsyncs)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump({"format": FORMAT, "snapshots": recorded}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # a deleted snapshot must not come back, nor a recorded one vanish
        finally:
            os.close(fd)

    def load(self, headers: dict[int, SlotHeader | None], slots: int) -> str:
        """Reads the recorded snapshots, checking each pinned slot against `headers` (every
        slot's header as read at recovery). Returns "" or why the record cannot be read."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return ""
        except OSError as exc:
            return f"{self.path} cannot be read ({exc})"
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                return f"{self.path} has format {data.get('format')}, this daemon reads format {FORMAT}"
            for name, entry in data["snapshots"].items():
                snap = Snapshot(name, int(entry["step"]), float(entry["created"]))
                for sid, slot in entry["slots"].items():
                    header = headers.get(slot) if 0 <= slot < slots else None
                    if header is None or header.shard_id != int(sid) or header.version != snap.step:
                        found = "none" if header is None else f"shard {header.shard_id} version {header.version}"
                        snap.damaged = snap.damaged or (
                            f"slot {slot} should hold shard {sid} at version {snap.step}; its header says {found}"
                        )
                    self._pin(snap, int(sid), slot, header)
                self.snapshots[name] = snap
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.snapshots.clear()
            self.pins.clear()
            return f"{self.path} is damaged ({exc!r})"
        return ""

    def remove_file(self) -> None:
        self.path.with_name(self.path.name + ".tmp").unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)
