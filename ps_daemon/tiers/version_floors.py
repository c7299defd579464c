"""Each shard's committed version as last recorded beside its model's arena file: a floor
that recovery holds the slot headers to, so that a damaged header is never a silent rollback.

Why. Recovery (ps_offload.daemon.tiers.nvme) takes, per shard, the valid slot header with the newest
version. A freed slot keeps the header of the version it held until it is reused, so when
the newest header is damaged (a flipped bit fails its crc32c, or the block reads back as
zeros), the shard's previous header looks newest and the shard would come back one version
older, behind every trainer, with nothing said. With the floors, a shard whose newest readable
header is older than its recorded floor is refused with DATA_LOSS naming it.

What is recorded. A version becomes a floor only after its commit is durable (the header's
fdatasync), and floors only rise, so a floor is never above what the disk holds: a crash
between a commit and the next record leaves a lower floor, which is still true. The file is
rewritten whole (temporary file, fsync, rename) at most every `store.nvme_floor_seconds`
while commits come in, and at a clean stop. A version committed less than that before its
header is damaged is not covered; nor is a shard whose floors file is itself damaged (the
daemon then says so and starts recording afresh from the headers it finds).

Format: magic, count, then (shard id u32, version u64) pairs, then the crc32c of all before.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path

import crc32c

log = logging.getLogger(__name__)

_MAGIC = b"PSOFVFL1"
_PREFIX = struct.Struct("<8sI")
_ENTRY = struct.Struct("<IQ")
_CRC = struct.Struct("<I")


class VersionFloors:
    """One model's floors: shard id -> the newest version known durable. Thread-safe."""

    def __init__(self, path: Path, versions: dict[int, int] | None = None) -> None:
        self.path = path
        self._versions = dict(versions or {})
        self._lock = threading.Lock()
        self._dirty = bool(self._versions)
        self._writing = threading.Lock()  # one write at a time, and none once retired
        self._retired = False

    @classmethod
    def load(cls, path: Path) -> tuple[VersionFloors, str]:
        """The floors recorded at `path`, and "" or why none could be read (then there are
        none: nothing to hold the headers to). A missing file is no problem: a model that
        never committed, or one from a release before floors."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls(path), ""
        except OSError as exc:
            return cls(path), f"{path} cannot be read ({exc})"
        try:
            versions = _decode(data)
        except ValueError as exc:
            return cls(path), f"{path} is damaged ({exc})"
        return cls(path, versions), ""

    def get(self, shard_id: int) -> int:
        with self._lock:
            return self._versions.get(shard_id, 0)

    def raise_to(self, shard_id: int, version: int) -> None:
        """Records that `version` of the shard is durable (never lowers a floor)."""
        with self._lock:
            if version > self._versions.get(shard_id, 0):
                self._versions[shard_id] = version
                self._dirty = True

    def hold_to(self, newest: dict[int, int], shard_ids: set[int], arena_name: str) -> dict[int, str]:
        """Holds each shard's newest readable version (`newest`, from the slot headers of the
        file `arena_name`) to its floor. Returns why each shard below its floor is refused;
        the floors of the others rise to what the headers say (a record from before a crash
        may be lower), those of the refused stay, so they are refused again after a restart."""
        lost = {}
        for shard_id in sorted(shard_ids):
            floor, found = self.get(shard_id), newest.get(shard_id, 0)
            if floor > found:
                readable = f"the newest readable slot header is version {found}" if found else "no slot header names it"
                lost[shard_id] = (
                    f"version {floor} was committed ({self.path.name} records it) but {readable}: the newest header "
                    f"in {arena_name} is damaged, and the shard is refused rather than rolled back. Restore the model "
                    f"from a copy, or, to accept version {found}, move {self.path.name} out of nvme_dir and restart"
                )
            elif shard_id in newest:
                self.raise_to(shard_id, found)
        return lost

    def write(self) -> None:
        """Rewrites the file if a floor rose since the last write. Raises OSError (the floors
        stay marked for the next try)."""
        with self._writing:
            if self._retired:
                return
            with self._lock:
                if not self._dirty:
                    return
                data = _encode(self._versions)
                self._dirty = False
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                tmp.replace(self.path)  # no directory fsync: the old file, if it comes back, is lower
            except BaseException:
                with self._lock:
                    self._dirty = True
                tmp.unlink(missing_ok=True)
                raise

    def retire(self) -> None:
        """No write from now on (its model is being deleted: a write already running ends
        first, so none lands after the file is gone)."""
        with self._writing:
            self._retired = True

    def remove(self) -> None:
        """Deletes the file (a new model of the same name must not be held to an old one's)."""
        self.path.with_name(self.path.name + ".tmp").unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)


def _encode(versions: dict[int, int]) -> bytes:
    body = _PREFIX.pack(_MAGIC, len(versions)) + b"".join(
        _ENTRY.pack(shard_id, version) for shard_id, version in sorted(versions.items())
    )
    return body + _CRC.pack(crc32c.crc32c(body))


def _decode(data: bytes) -> dict[int, int]:
    if len(data) < _PREFIX.size + _CRC.size:
        raise ValueError(f"{len(data)} bytes, too short")
    magic, count = _PREFIX.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("not a floors file")
    body_bytes = _PREFIX.size + count * _ENTRY.size
    if len(data) != body_bytes + _CRC.size:
        raise ValueError(f"{len(data)} bytes for {count} entries")
    (crc,) = _CRC.unpack_from(data, body_bytes)
    if crc32c.crc32c(data[:body_bytes]) != crc:
        raise ValueError("checksum mismatch")
    return dict(_ENTRY.iter_unpack(data[_PREFIX.size : body_bytes]))


class FloorWriter:
    """A thread that writes every model's floors every `interval` seconds; `stop` writes
    them once more. Failures are logged (once per run of failures), never raised: a floor
    not recorded only narrows what recovery can check."""

    def __init__(self, floors_of, interval: float) -> None:
        self._floors_of = floors_of  # () -> the VersionFloors of every open model
        self._interval = interval
        self._stopped = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="version-floors", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self.write_all()

    def write_all(self) -> None:
        failed = ""
        for floors in self._floors_of():
            try:
                floors.write()
            except OSError as exc:
                failed = f"{floors.path}: {exc}"
        if failed and not self._failing:
            log.warning("recording committed versions failed (%s); retrying every %.1fs", failed, self._interval)
        elif self._failing and not failed:
            log.info("recording committed versions works again")
        self._failing = bool(failed)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        self.write_all()
