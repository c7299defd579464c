"""Shards at rest: one arena file per model under `nvme_dir`, O_DIRECT, crc32c-checked.

Layout. A model's file holds two slots (A, B) per shard this daemon owns, in plan order.
A slot is a 4 KiB header block followed by the shard's arena (master, then optimizer
state: ps_daemon.store) rounded up to 4 KiB:

    [shard 0 slot A][shard 0 slot B][shard 1 slot A][shard 1 slot B] ...

Commit protocol (what "committed" means; docs/architecture.md). Version v+1 of a shard
goes into the slot that does not hold v: (1) the arena bytes, (2) fdatasync, (3) the header
(version, crc32c of the bytes, its own crc32c), (4) fdatasync. Only then is the push
acknowledged. A crash before (3) leaves that slot's old header, which names an older
version, so recovery keeps v; a crash after (3) leaves v+1 complete. Recovery therefore
takes the slot whose header is valid and newest, and if that slot's bytes fail their
checksum the shard is corrupt at rest: it is refused with DATA_LOSS, never silently rolled
back to an older version the trainer has already moved past.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import crc32c
import torch

from ps_daemon.optim import AdamWConfig, SGDConfig

PAGE = 4096
_MAGIC = b"PSOFSHD1"
# magic, format, shard_id, version, initialized, numel, arena_bytes, data_crc; then header_crc
_HEADER = struct.Struct("<8sIIQB3xQQI")
_HEADER_CRC = struct.Struct("<I")
FORMAT_VERSION = 1


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def aligned_empty(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Page-aligned, zero-filled memory (anonymous mmap) that O_DIRECT can read and write,
    `nbytes` rounded up to whole pages."""
    region = mmap.mmap(-1, round_up(max(nbytes, 1)))
    return region, memoryview(region)


@dataclass(frozen=True)
class SlotHeader:
    shard_id: int
    version: int
    initialized: bool
    numel: int
    arena_bytes: int
    data_crc: int

    def pack(self) -> bytes:
        body = _HEADER.pack(
            _MAGIC, FORMAT_VERSION, self.shard_id, self.version, self.initialized, self.numel,
            self.arena_bytes, self.data_crc,
        )  # fmt: skip
        return body + _HEADER_CRC.pack(crc32c.crc32c(body))

    @classmethod
    def unpack(cls, block: bytes | memoryview) -> SlotHeader | None:
        """None for a block that is not a valid header (never written, or torn)."""
        body = bytes(block[: _HEADER.size])
        (crc,) = _HEADER_CRC.unpack_from(block, _HEADER.size)
        if crc32c.crc32c(body) != crc:
            return None
        magic, fmt, shard_id, version, initialized, numel, arena_bytes, data_crc = _HEADER.unpack(body)
        if magic != _MAGIC or fmt != FORMAT_VERSION:
            return None
        return cls(shard_id, version, bool(initialized), numel, arena_bytes, data_crc)


class DirectIO:
    """Positional reads and writes with O_DIRECT, split into blocks with several in flight
    on a thread pool (os.preadv/pwritev release the GIL)."""

    def __init__(self, *, threads: int, block_bytes: int) -> None:
        self.block_bytes = round_up(block_bytes)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nvme-io")
        self._fault = _injected_write_fault()

    def _check_fault(self) -> None:
        if self._fault is not None:
            self._fault.tick()

    def _blocks(self, view: memoryview, offset: int):
        for start in range(0, len(view), self.block_bytes):
            yield view[start : start + self.block_bytes], offset + start

    @staticmethod
    def _write_block(fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], offset + done)

    @staticmethod
    def _read_block(fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"unexpected end of file at offset {offset + done}")
            done += n

    def _run(self, fn, fd: int, view: memoryview, offset: int) -> None:
        futures = [self._pool.submit(fn, fd, block, at) for block, at in self._blocks(view, offset)]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def write(self, fd: int, view: memoryview, offset: int) -> None:
        self._check_fault()
        self._run(self._write_block, fd, view, offset)

    def read(self, fd: int, view: memoryview, offset: int) -> None:
        self._run(self._read_block, fd, view, offset)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


FAULT_ENV = "PS_OFFLOAD_INJECT_WRITE_ERROR"


class _WriteFault:
    """Testing aid: `PS_OFFLOAD_INJECT_WRITE_ERROR=ENOSPC@N` makes every write after the
    first N fail with that errno, the way a full or failing disk does, so the tests can
    show what the daemon does then without a real full disk (tmpfs has no O_DIRECT)."""

    def __init__(self, errno_value: int, after: int) -> None:
        self.errno_value, self.remaining = errno_value, after
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            if self.remaining > 0:
                self.remaining -= 1
                return
        raise OSError(self.errno_value, f"{os.strerror(self.errno_value)} (injected by {FAULT_ENV})")


def _injected_write_fault() -> _WriteFault | None:
    setting = os.environ.get(FAULT_ENV)
    if not setting:
        return None
    name, _, after = setting.partition("@")
    return _WriteFault(getattr(errno, name), int(after or 0))


def _optimizer_to_json(config: AdamWConfig | SGDConfig) -> dict:
    return {"type": "adamw" if isinstance(config, AdamWConfig) else "sgd", **asdict(config)}


def _optimizer_from_json(data: dict) -> AdamWConfig | SGDConfig:
    kind = data.pop("type")
    return AdamWConfig(**data) if kind == "adamw" else SGDConfig(**data)


def spec_to_json(spec, daemon_index: int) -> str:
    return json.dumps(
        {
            "format": FORMAT_VERSION,
            "daemon_index": daemon_index,
            "model": spec.model,
            "params": [
                {"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "weight_decay": p.weight_decay}
                for p in spec.params
            ],
            "optimizer": _optimizer_to_json(spec.optimizer),
            "shard_bytes": spec.shard_bytes,
            "daemons": list(spec.daemons),
        },
        indent=1,
    )


def spec_from_json(text: str):
    from ps_daemon.store import ModelSpec, ParamSpec  # the store imports this module

    data = json.loads(text)
    params = tuple(ParamSpec(p["name"], tuple(p["shape"]), p["dtype"], p["weight_decay"]) for p in data["params"])
    spec = ModelSpec(
        data["model"], params, _optimizer_from_json(data["optimizer"]), data["shard_bytes"], tuple(data["daemons"])
    )
    return spec, data["daemon_index"]


@dataclass
class SlotState:
    """Where a shard's committed version lives in its model file."""

    offset: int  # of slot A; slot B follows at offset + slot_bytes
    slot_bytes: int
    active: int = -1  # index of the slot holding the last committed version; -1: none yet


class ModelFile:
    """One model's arena file and its shards' slots."""

    def __init__(self, directory: Path, model: str, arena_bytes: dict[int, int], *, create: bool) -> None:
        self.path = directory / f"{urllib.parse.quote(model, safe='')}.arena"
        self.slots: dict[int, SlotState] = {}
        offset = 0
        for shard_id, nbytes in arena_bytes.items():  # plan order
            slot = PAGE + round_up(nbytes)
            self.slots[shard_id] = SlotState(offset, slot)
            offset += 2 * slot
        self.size = offset
        flags = os.O_RDWR | os.O_DIRECT | (os.O_CREAT if create else 0)
        self.fd = os.open(self.path, flags, 0o600)
        if create and self.size:
            try:
                os.posix_fallocate(self.fd, 0, self.size)  # ENOSPC here, not mid-training
            except OSError:
                os.close(self.fd)
                self.path.unlink(missing_ok=True)
                raise

    def close(self) -> None:
        os.close(self.fd)


class NvmeFiles:
    """The daemon's files under nvme_dir: model specs (JSON) and model arena files."""

    def __init__(self, directory: str | Path, *, io: DirectIO, fsync: bool) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.io = io
        self.fsync = fsync
        self.files: dict[str, ModelFile] = {}
        # One aligned block for header I/O; commits of different shards run concurrently, so
        # it has a lock of its own (held for the 4 KiB read or write only).
        self._header_region, self._header = aligned_empty(PAGE)
        self._header_lock = threading.Lock()
        self.bytes_written = 0  # shard bytes, counted once the write returned
        self.bytes_read = 0

    # -- models ------------------------------------------------------------------------

    def _spec_path(self, model: str) -> Path:
        return self.dir / f"{urllib.parse.quote(model, safe='')}.json"

    def create_model(self, spec, daemon_index: int, arena_bytes: dict[int, int]) -> None:
        """Allocates the model's file and records its spec (atomically: temp, fsync, rename)."""
        self.files[spec.model] = ModelFile(self.dir, spec.model, arena_bytes, create=True)
        path = self._spec_path(spec.model)
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            f.write(spec_to_json(spec, daemon_index))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        self._sync_dir()

    def recorded_models(self) -> list[tuple[object, int]]:
        """(spec, daemon_index) of every model recorded in the directory."""
        return [spec_from_json(p.read_text()) for p in sorted(self.dir.glob("*.json"))]

    def open_model(self, spec, arena_bytes: dict[int, int]) -> None:
        self.files[spec.model] = ModelFile(self.dir, spec.model, arena_bytes, create=False)

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
        """Writes a new committed version of the shard (the protocol in the module doc).
        `arena` is page-aligned and whole pages long. Raises OSError; the previous committed
        version is then intact on disk."""
        file = self.files[model]
        slot = file.slots[shard_id]
        target = 1 - slot.active if slot.active >= 0 else 0
        at = slot.offset + target * slot.slot_bytes
        self.io.write(file.fd, arena, at + PAGE)
        if self.fsync:
            os.fdatasync(file.fd)
        header = SlotHeader(shard_id, version, initialized, numel, len(arena), crc32c.crc32c(arena))
        packed = header.pack()
        with self._header_lock:
            self._header[:] = packed + bytes(PAGE - len(packed))
            self.io.write(file.fd, self._header, at)
        if self.fsync:
            os.fdatasync(file.fd)
        slot.active = target
        with self._header_lock:
            self.bytes_written += len(arena)

    def newest_header(self, model: str, shard_id: int) -> SlotHeader | None:
        """The header of the newest committed version (None if none); remembers its slot."""
        found = self._newest(model, shard_id)
        return found[1] if found else None

    def _newest(self, model: str, shard_id: int) -> tuple[int, SlotHeader] | None:
        file = self.files[model]
        slot = file.slots[shard_id]
        headers = []
        for index in (0, 1):
            with self._header_lock:
                self.io.read(file.fd, self._header, slot.offset + index * slot.slot_bytes)
                header = SlotHeader.unpack(self._header)
            if header is not None and header.shard_id == shard_id:
                headers.append((header.version, index, header))
        if not headers:
            slot.active = -1
            return None
        _, index, header = max(headers)
        slot.active = index
        return index, header

    def load(self, model: str, shard_id: int, arena: memoryview) -> SlotHeader | None:
        """Reads the newest committed version into `arena`; None if none was ever committed.
        Raises CorruptShard when that version's bytes fail their checksum."""
        found = self._newest(model, shard_id)
        if found is None:
            return None  # never committed: the caller starts from zeros
        index, header = found
        file = self.files[model]
        slot = file.slots[shard_id]
        if header.arena_bytes != len(arena):
            raise CorruptShard(f"header says {header.arena_bytes} arena bytes, the shard has {len(arena)}")
        self.io.read(file.fd, arena, slot.offset + index * slot.slot_bytes + PAGE)
        if crc32c.crc32c(arena) != header.data_crc:
            raise CorruptShard(f"checksum mismatch in slot {'AB'[index]} (version {header.version})")
        with self._header_lock:
            self.bytes_read += len(arena)
        return header

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.io.close()


class CorruptShard(Exception):
    """A shard's newest committed bytes on disk do not match their checksum."""


def arena_tensor(numel: int, nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A zeroed fp32 tensor of `numel` elements over page-aligned memory whose whole-page
    extent (`nbytes` rounded up) is returned as the view O_DIRECT reads and writes."""
    region, view = aligned_empty(nbytes)
    tensor = torch.frombuffer(region, dtype=torch.float32, count=numel)
    return tensor, view
