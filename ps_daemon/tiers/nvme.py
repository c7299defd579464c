"""Shards at rest: one arena file per model under `nvme_dir`, O_DIRECT, crc32c-checked.

Layout. A model's file is a row of equal slots, each a 4 KiB header block (ps_offload.daemon.tiers.
slot_header) followed by room for the model's largest shard arena (master, then optimizer
state: ps_offload.daemon.store.shard):

    [slot 0][slot 1] ... [slot N-1][spare 0] ... [spare K-1]

There are N + K slots for N shards: every shard's committed version holds one slot, and K
spare slots (`store.nvme_spare_slots`, at most N) take the versions being written. So the
disk holds the state about once (N + K over N), not twice as a fixed A/B pair per shard
would, and K bounds how many commits run at once.

Commit protocol (what "committed" means; docs/storage.md). Version v+1 of a shard goes into a
free slot: (1) the arena bytes, (2) fdatasync, (3) the header (shard id, version, crc32c of the
bytes and of their master region, its own crc32c), (4) fdatasync. Only then is the push
acknowledged, and the slot that held v becomes free. Commits that arrive while others are being
written queue and go to disk as one group (ps_offload.daemon.tiers.commit_group): every arena
of the group, one flush, every header, one flush. A crash before (3) leaves the slot's old
header, which names another shard or an older version, so recovery keeps v; a crash after (3)
leaves v+1 complete. A freed slot keeps its stale header until it is reused, always older than
its shard's newest. Recovery therefore reads every slot's header and takes, per shard, the
valid header with the newest version; if that slot's bytes fail their checksum the shard is
corrupt at rest and refused with DATA_LOSS, never silently rolled back to an older version the
trainer has already moved past.

Reads. `load` reads a committed arena whole (the RAM tier's swap-in); `read_master` reads only
its master region, for a pull of a shard that is not in RAM (ps_offload.daemon.store.master_pull). The
slot being read must stay the shard's: its caller holds the shard for reading, which keeps
the shard's next commit, the only thing that frees that slot, waiting.

Formats. A model's record (the JSON beside its file) and each slot header carry a format
number. Format 2 files, from the release before master checksums, are read; opening one
rewrites its record as format 3 before anything is committed, so that the previous release,
which would take this release's headers for torn ones and recover an older version, refuses
the file instead.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from pathlib import Path

import crc32c

from ps_offload.daemon.tiers import crash_points
from ps_offload.daemon.tiers.commit_group import PendingCommit
from ps_offload.daemon.tiers.direct_io import DirectIO
from ps_offload.daemon.tiers.model_file import FileLayout, ModelFile
from ps_offload.daemon.tiers.slot_header import (
    FORMAT_VERSION,
    READABLE_FORMATS,
    SlotHeader,
    checksums,
    master_region_bytes,
)
from ps_offload.daemon.tiers.tier import PAGE, CorruptShard, NoCapacity, SlotCheck, aligned_empty
from ps_offload.daemon.tiers.version_floors import FloorWriter, VersionFloors

log = logging.getLogger(__name__)


def spec_to_json(spec: dict, daemon_index: int, layout: FileLayout) -> str:
    return json.dumps(
        {
            "format": FORMAT_VERSION,
            "daemon_index": daemon_index,
            "layout": {"slot_bytes": layout.slot_bytes, "slots": layout.slots},
            **spec,
        },
        indent=1,
    )


def spec_from_json(text: str, parse: Callable[[dict], object]) -> tuple[object, int, FileLayout]:
    data = json.loads(text)
    if data.get("format") not in READABLE_FORMATS:
        readable = " and ".join(str(f) for f in READABLE_FORMATS)
        raise ValueError(f"format {data.get('format')}, this daemon reads formats {readable}")
    return parse(data), data["daemon_index"], FileLayout(**data["layout"])


class NvmeFiles:
    """The daemon's files under nvme_dir: model specs (JSON) and model arena files.

    capacity: bytes all arena files together may take (0: as much as the disk has).
    spare_slots: slots per model beyond one per shard, for versions being written.
    floor_seconds: how often each model's committed versions are recorded (version_floors)."""

    at_rest = True  # ps_offload.daemon.tiers.tier.ShardFiles: committed versions survive a restart

    def __init__(
        self,
        directory: str | Path,
        *,
        io: DirectIO,
        fsync: bool,
        capacity: int = 0,
        spare_slots: int = 8,
        floor_seconds: float = 1.0,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.io = io
        self.fsync = fsync
        self.capacity = capacity
        self.spare_slots = spare_slots
        self.slot_timeout = 120.0
        self.files: dict[str, ModelFile] = {}
        # One aligned block for header I/O; commits of different shards run concurrently, so
        # it has a lock of its own (held for the 4 KiB read or write only).
        self._header_region, self._header = aligned_empty(PAGE)
        self._header_lock = threading.Lock()
        self._grow_lock = threading.Lock()
        self.bytes_written = 0  # shard bytes, counted once the write returned
        self.bytes_read = 0  # by loads and master-only reads (not verify's)
        self.master_reads = 0  # read_master calls that read a master region
        self.master_bytes_read = 0  # the part of bytes_read they took
        # Wall time of commits (bytes, fdatasync, header, fdatasync) and of reads (read, crc),
        # summed over threads: with several in flight, more than the elapsed time.
        self.write_seconds = 0.0
        self.read_seconds = 0.0
        # Group commit: commits made durable, the groups they went in, the fdatasyncs of
        # commits and their time (ps_offload.daemon.tiers.commit_group, group_sync).
        self.commits = 0
        self.commit_groups = 0
        self.flushes = 0
        self.flush_seconds = 0.0
        self._floor_writer = FloorWriter(lambda: [f.floors for f in list(self.files.values())], floor_seconds)

    @property
    def bytes_allocated(self) -> int:
        return sum(f.layout.size for f in self.files.values())

    # -- models ------------------------------------------------------------------------

    def arena_path(self, model: str) -> Path:
        return self.dir / f"{urllib.parse.quote(model, safe='')}.arena"

    def _spec_path(self, model: str) -> Path:
        return self.dir / f"{urllib.parse.quote(model, safe='')}.json"

    def layout_for(self, arena_bytes: dict[int, int]) -> FileLayout:
        return FileLayout.for_shards(arena_bytes, spare_slots=self.spare_slots)

    def create_model(self, spec: dict, daemon_index: int, arena_bytes: dict[int, int]) -> FileLayout:
        """Allocates the model's file and records its spec and layout (atomically: temp,
        fsync, rename). Raises NoCapacity past `capacity`, OSError (ENOSPC) past the disk."""
        layout = self.layout_for(arena_bytes)
        if self.capacity and self.bytes_allocated + layout.size > self.capacity:
            raise NoCapacity(
                f"it needs {layout.size} bytes on NVMe ({layout.slots} slots of {layout.slot_bytes}: one per "
                f"shard and {layout.slots - len(arena_bytes)} spare); store.nvme_bytes is {self.capacity} and "
                f"{self.bytes_allocated} are taken"
            )
        file = ModelFile(self.dir, spec["model"], layout, create=True, on_flush=self._flushed)
        try:
            self._write_record(spec["model"], spec_to_json(spec, daemon_index, layout))
        except BaseException:
            # No record, no model: the arena must not stay behind, taking the disk's room.
            file.close()
            file.path.unlink(missing_ok=True)
            raise
        self.files[spec["model"]] = file
        return layout

    def _write_record(self, model: str, text: str) -> None:
        """Replaces the model's record atomically: a temporary file, fsynced, renamed."""
        path = self._spec_path(model)
        tmp = path.with_suffix(".json.tmp")
        try:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # (a full disk fails the write or the fsync)
            raise
        self._sync_dir()

    def recorded_models(
        self, damaged: dict[str, str] | None = None, *, parse: Callable[[dict], object] = dict
    ) -> list[tuple[object, int, FileLayout]]:
        """(spec, daemon_index, layout) of every model recorded in the directory. A record
        that cannot be read raises OSError naming the file; with `damaged` given, it goes
        there instead (model name, from the file's name -> why), and the others are read."""
        models = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                models.append(spec_from_json(path.read_text(), parse))
            except (ValueError, KeyError, TypeError, OSError) as exc:
                why = (
                    f"{path} is not a model record this daemon can read ({exc}); move it and its .arena file "
                    "out of nvme_dir, or run the ps-offload release that wrote it"
                )
                if damaged is None:
                    raise OSError(why) from exc
                damaged[urllib.parse.unquote(path.name.removesuffix(".json"))] = why
        return models

    def grow(self, model: str, extra_slots: int) -> None:
        """Adds `extra_slots` free slots to the end of a model's file (ps_offload.daemon.tiers.snapshot_pins),
        then records the new slot count. Raises NoCapacity or OSError (ENOSPC) with nothing
        changed but, at worst, blocks reserved past the recorded end."""
        with self._grow_lock:
            file = self.files[model]
            layout = FileLayout(file.layout.slot_bytes, file.layout.slots + extra_slots)
            more = layout.size - file.layout.size
            if self.capacity and self.bytes_allocated + more > self.capacity:
                raise NoCapacity(
                    f"{extra_slots} more slots take {more} bytes on NVMe; store.nvme_bytes is {self.capacity} and "
                    f"{self.bytes_allocated} are taken"
                )
            os.posix_fallocate(file.fd, 0, layout.size)
            data = json.loads(self._spec_path(model).read_text())
            data["layout"] = {"slot_bytes": layout.slot_bytes, "slots": layout.slots}
            self._write_record(model, json.dumps(data, indent=1))
            file.grown(layout)

    def delete_model(self, model: str) -> int:
        """Closes a model's file if open and deletes it, its record and its versions record
        (ps_offload.daemon.store.drop: nothing may be using the file). Returns the bytes freed."""
        file = self.files.get(model)
        if file is not None:
            file.floors.retire()  # the floor writer must not bring MODEL.versions back
            with file.cond:  # a snapshot waiting for its step ends NOT_FOUND (snapshot_admin.take)
                file.dropped = True
                file.cond.notify_all()
        self.forget(model)
        arena = self.arena_path(model)
        paths = [arena, self._spec_path(model), arena.with_suffix(".versions"), arena.with_suffix(".snapshots")]
        paths += [p.with_name(p.name + ".tmp") for p in paths[1:]]
        freed = 0
        for path in paths:
            try:
                freed += path.stat().st_blocks * 512
                path.unlink()
            except FileNotFoundError:
                pass
        self._sync_dir()
        return freed

    def restart_problem(self, model: str) -> str:
        """Why this open model would not come back at the next start, "" when it would: its
        arena file deleted, replaced or truncated under the daemon, or its record gone or
        unreadable. (The daemon serves from the file it has open, so nothing else shows it.)"""
        file = self.files.get(model)
        if file is None:
            return ""
        try:
            on_disk = os.stat(file.path)
        except FileNotFoundError:
            return f"its arena file {file.path} was deleted (the daemon still has it open; a restart loses the model)"
        held = os.fstat(file.fd)
        if (on_disk.st_dev, on_disk.st_ino) != (held.st_dev, held.st_ino):
            return f"its arena file {file.path} was replaced by another file (a restart would read that one)"
        if on_disk.st_size < file.layout.size:
            return f"its arena file {file.path} is truncated: {on_disk.st_size} of {file.layout.size} bytes"
        record = self._spec_path(model)
        try:
            spec_from_json(record.read_text(), dict)
        except FileNotFoundError:
            return f"its record {record} was deleted (a restart would not know the model)"
        except (ValueError, KeyError, TypeError, OSError) as exc:
            return f"its record {record} cannot be read ({exc})"
        return ""

    def forget(self, model: str) -> None:
        """Closes a model's file if it is open (a model that could not be recovered)."""
        file = self.files.pop(model, None)
        if file is not None:
            file.close()

    def open_model(self, spec, layout: FileLayout, shard_ids: set[int]) -> tuple[dict[int, SlotHeader], dict[int, str]]:
        """Opens a recorded model's file and finds each shard's newest committed version by
        reading every slot's header (not the bytes: a model may be larger than RAM).
        Returns the header of each shard that has one, and why each shard whose newest header
        is older than its recorded floor (version_floors) cannot be trusted."""
        file = ModelFile(self.dir, spec.model, layout, create=False, on_flush=self._flushed)
        newest: dict[int, tuple[int, SlotHeader]] = {}
        headers: dict[int, SlotHeader | None] = {}  # every slot's, for the snapshots' check
        for slot in range(layout.slots):
            with self._header_lock:
                self.io.read(file.fd, self._header, file.offset(slot))
                header = headers[slot] = SlotHeader.unpack(self._header)
            if header is None or header.shard_id not in shard_ids:
                continue
            known = newest.get(header.shard_id)
            if known is None or header.version > known[1].version:
                newest[header.shard_id] = (slot, header)
        file.active = newest
        file.floors, problem = VersionFloors.load(file.floors.path)
        if problem:
            log.warning(
                "model %r: %s; a shard whose newest header is damaged cannot be told from one at its previous "
                "version until every shard has committed again",
                spec.model, problem,
            )  # fmt: skip
        versions = {shard_id: header.version for shard_id, (_, header) in newest.items()}
        lost = file.floors.hold_to(versions, shard_ids, file.path.name)
        problem = file.snapshots.load(headers, layout.slots)
        if problem:
            log.warning("model %r: %s; its snapshots are forgotten", spec.model, problem)
        taken = {slot for slot, _ in newest.values()}
        file.free = deque(s for s in range(layout.slots) if s not in taken and not file.snapshots.is_pinned(s))
        self._upgrade_record(spec.model)
        self.files[spec.model] = file
        return {shard_id: header for shard_id, (_, header) in newest.items()}, lost

    def _upgrade_record(self, model: str) -> None:
        """Marks an older format's record as this release's before any commit writes a header
        of this format into its file (the module doc says why). The slots keep their headers."""
        data = json.loads(self._spec_path(model).read_text())
        if data["format"] != FORMAT_VERSION:
            log.info("model %r: record format %d rewritten as %d", model, data["format"], FORMAT_VERSION)
            self._write_record(model, json.dumps({**data, "format": FORMAT_VERSION}, indent=1))

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- shards ------------------------------------------------------------------------

    def commit(
        self, model: str, shard_id: int, arena: memoryview, *, version: int, initialized: bool, numel: int
    ) -> None:
        """Writes a new committed version of the shard (the protocol in the module doc), with
        the commits that queued beside it (ps_offload.daemon.tiers.commit_group). `arena` is
        page-aligned and whole pages long. Raises OSError or NoFreeSlot; the previous committed
        version is then intact on disk."""
        file = self.files[model]
        slot = file.take_slot(self.slot_timeout)
        pending = PendingCommit(shard_id, slot, arena, version, initialized, numel)
        file.groups.run(pending, lambda group: self._write_group(file, group))

    def _write_group(self, file: ModelFile, group: list[PendingCommit]) -> None:
        """Every arena of the group, one flush, every header, one flush; then each commit's
        slot becomes its shard's. A commit whose write fails fails alone; a failed flush fails
        every commit it was to cover."""
        started = time.perf_counter()
        try:
            crash_points.reached("before_data")
            # The checksums are taken in this thread while the I/O threads write the bytes.
            sums, errors = self.io.write_parts(
                file.fd,
                [(c.arena, file.offset(c.slot) + PAGE) for c in group],
                meanwhile=lambda: [checksums(c.arena, c.numel) for c in group],
            )
            for c, (master_bytes, master_crc, data_crc), error in zip(group, sums, errors, strict=True):
                c.error = error
                c.header = SlotHeader(
                    c.shard_id, c.version, c.initialized, c.numel, len(c.arena), data_crc, master_bytes, master_crc
                )
            crash_points.reached("data_written")
            written = [c for c in group if c.error is None]
            if written and self.fsync:
                self._flush(file, written)  # one flush for every arena of the group
            crash_points.reached("data_synced")
            for c in written:
                if c.error is None:
                    self._write_header(file, c)
            crash_points.reached("header_written")
            headed = [c for c in written if c.error is None]
            if headed and self.fsync:
                self._flush(file, headed)  # one flush for every header of the group
            crash_points.reached("header_synced")
            for c in headed:
                if c.error is None:
                    file.committed(c.shard_id, c.slot, c.header)
                    file.floors.raise_to(c.shard_id, c.version)
                    c.committed = True
        finally:
            for c in group:
                if not c.committed:
                    self._failed(file, c)
            with self._header_lock:
                self.bytes_written += sum(len(c.arena) for c in group if c.committed)
                self.write_seconds += time.perf_counter() - started
                committed = sum(c.committed for c in group)
                self.commits += committed
                self.commit_groups += committed > 0  # a group that committed nothing is in no figure

    def _flushed(self, seconds: float) -> None:
        with self._header_lock:
            self.flushes += 1
            self.flush_seconds += seconds

    @staticmethod
    def _flush(file: ModelFile, covered: list[PendingCommit]) -> None:
        """One fdatasync for `covered`; if it fails, so does each of them."""
        try:
            file.flushes.sync()  # shared with any other group's (group_sync)
        except OSError as exc:
            for c in covered:
                c.error = exc

    def _write_header(self, file: ModelFile, c: PendingCommit) -> None:
        packed = c.header.pack()
        with self._header_lock:
            self._header[:] = packed + bytes(PAGE - len(packed))
            c.header_written = True  # from here the slot may name this version on disk
            try:
                self.io.write(file.fd, self._header, file.offset(c.slot))
            except OSError as exc:
                c.error = exc

    @staticmethod
    def _failed(file: ModelFile, c: PendingCommit) -> None:
        if c.header_written:
            # Its header may have reached the disk naming a version newer than the committed
            # one; reused for another shard and torn by a crash, it would make recovery pick a
            # corrupt "newest". Leave it out until the next restart.
            log.error("slot %d of %s is left unused until restart after a failed commit", c.slot, file.path)
        else:
            file.give_back(c.slot)

    def load(self, model: str, shard_id: int, arena: memoryview) -> SlotHeader | None:
        """Reads the committed version into `arena`; None if none was ever committed.
        Raises CorruptShard when its bytes fail their checksum."""
        file = self.files[model]
        with file.cond:
            found = file.active.get(shard_id)
        if found is None:
            return None  # never committed: the caller starts from zeros
        slot, header = found
        if header.arena_bytes != len(arena):
            raise CorruptShard(f"header says {header.arena_bytes} arena bytes, the shard has {len(arena)}")
        started = time.perf_counter()
        self.read_slot(model, slot, header, arena)
        with self._header_lock:
            self.bytes_read += len(arena)
            self.read_seconds += time.perf_counter() - started
        return header

    def read_slot(self, model: str, slot: int, header: SlotHeader, arena: memoryview) -> None:
        """Reads the arena bytes of `slot` (a committed or a pinned one: the caller keeps it
        from being reused) into `arena`, `header.arena_bytes` long and page-aligned, and checks
        their crc32c against the header's (CorruptShard)."""
        file = self.files[model]
        crc = _FoldedCrc()  # over each block as it lands, while the later ones are read
        self.io.read(file.fd, arena[: header.arena_bytes], file.offset(slot) + PAGE, on_block=crc.add)
        if crc.value != header.data_crc:
            raise CorruptShard(f"checksum mismatch in slot {slot} (version {header.version})")

    def read_master(self, model: str, slot: int, header: SlotHeader, buffer: memoryview) -> None:
        """Reads the master region of `slot` (its first `header.master_bytes` arena bytes) into
        `buffer` (page-aligned, at least that long) and checks its crc32c. `slot` and `header`
        are committed_slot's answer, still the shard's committed slot: the caller holds the
        shard for reading, which keeps its next commit from freeing the slot meanwhile. The
        header must have a master checksum (format 3). Raises CorruptShard when the region
        fails its checksum, or when the header disagrees with itself about its size."""
        master_bytes = header.master_bytes
        if header.master_crc is None:
            raise ValueError(f"slot {slot} was written in format {header.format}, without a master checksum")
        if master_bytes != master_region_bytes(header.numel, header.arena_bytes) or master_bytes > len(buffer):
            raise CorruptShard(
                f"header of slot {slot} says {master_bytes} master bytes for {header.numel} values in "
                f"{header.arena_bytes} arena bytes"
            )
        file = self.files[model]
        started = time.perf_counter()
        region = buffer[:master_bytes]
        crc = _FoldedCrc()
        self.io.read(file.fd, region, file.offset(slot) + PAGE, on_block=crc.add)
        if crc.value != header.master_crc:
            raise CorruptShard(f"checksum mismatch in the master values of slot {slot} (version {header.version})")
        with self._header_lock:
            self.bytes_read += master_bytes
            self.master_reads += 1
            self.master_bytes_read += master_bytes
            self.read_seconds += time.perf_counter() - started

    # -- checks (ps-admin verify) ------------------------------------------------------

    def committed_slot(self, model: str, shard_id: int) -> tuple[int, SlotHeader] | None:
        """The slot holding the shard's committed version and its header; None if none was
        ever committed. Every commit stores a new tuple, so `is` on two answers tells whether
        a commit came in between (the slot may have been freed and reused meanwhile)."""
        file = self.files[model]
        with file.cond:
            return file.active.get(shard_id)

    def check_slot(self, model: str, slot: int, expected: SlotHeader, buffer: memoryview) -> SlotCheck:
        """Reads `slot`'s header and bytes back and checks them against `expected` (the
        header committed there) and their crc32c (and their master region's, in format 3),
        through `buffer` (page-aligned, whole pages) a block at a time. Reads in the calling
        thread, not the I/O pools, so a check never queues ahead of a shard the RAM tier is
        waiting for; nothing is cached or changed."""
        file = self.files[model]
        at = file.offset(slot)
        try:
            header_block = buffer[:PAGE]
            DirectIO._read_block(file.fd, header_block, at)
            found = SlotHeader.unpack(header_block)
            if found is None:
                return SlotCheck(expected.version, slot, PAGE, f"the header in slot {slot} fails its own checksum")
            if found != expected:
                return SlotCheck(
                    expected.version, slot, PAGE,
                    f"the header in slot {slot} names shard {found.shard_id} version {found.version} "
                    f"(crc32c {found.data_crc:08x}), committed was version {expected.version} "
                    f"(crc32c {expected.data_crc:08x})",
                )  # fmt: skip
            crc, done, master_crc = 0, 0, None
            while done < expected.arena_bytes:
                block = buffer[: min(len(buffer), expected.arena_bytes - done)]
                DirectIO._read_block(file.fd, block, at + PAGE + done)
                cut = min(max(expected.master_bytes - done, 0), len(block))  # the master region's part
                crc = crc32c.crc32c(block[:cut], crc)
                if cut and done + cut == expected.master_bytes:
                    master_crc = crc  # the whole arena's crc32c continues from the region's
                crc = crc32c.crc32c(block[cut:], crc)
                done += len(block)
        except OSError as exc:
            return SlotCheck(expected.version, slot, 0, f"slot {slot} cannot be read: {exc}")
        if crc != expected.data_crc:
            return SlotCheck(
                expected.version, slot, PAGE + done,
                f"checksum mismatch in slot {slot}: the bytes have crc32c {crc:08x}, the header says "
                f"{expected.data_crc:08x}",
            )  # fmt: skip
        if expected.master_crc is not None and master_crc != expected.master_crc:
            found_crc = "none" if master_crc is None else f"{master_crc:08x}"
            return SlotCheck(
                expected.version, slot, PAGE + done,
                f"checksum mismatch in the master values of slot {slot}: they have crc32c {found_crc}, the header "
                f"says {expected.master_crc:08x}",
            )  # fmt: skip
        return SlotCheck(expected.version, slot, PAGE + done, "")

    def check_buffer(self) -> tuple[mmap.mmap, memoryview]:
        """An aligned buffer for check_slot: one I/O block."""
        return aligned_empty(self.io.block_bytes)

    def close(self) -> None:
        self._floor_writer.stop()
        for file in self.files.values():
            file.close()
        self.io.close()


class _FoldedCrc:
    """crc32c of blocks given in order: the same value as one crc32c over them joined."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, block: memoryview) -> None:
        self.value = crc32c.crc32c(block, self.value)
