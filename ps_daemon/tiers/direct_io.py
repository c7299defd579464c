"""O_DIRECT I/O for the NVMe tier (ps_offload.daemon.tiers.nvme): page-aligned buffers, positional
reads and writes split into blocks with several in flight, and the injected write errors the
tests use in place of a full or failing disk. Nothing here knows shards or slots."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

PAGE = 4096


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def aligned_empty(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Page-aligned, zero-filled memory (anonymous mmap) that O_DIRECT can read and write,
    `nbytes` rounded up to whole pages."""
    region = mmap.mmap(-1, round_up(max(nbytes, 1)))
    return region, memoryview(region)


class DirectIO:
    """Positional reads and writes with O_DIRECT, split into blocks with several in flight
    (os.preadv/pwritev release the GIL). Reads and writes have queues and threads of their
    own, `threads` each: a swap-in that a pull waits for never queues behind the write-back
    of other shards."""

    def __init__(self, *, threads: int, block_bytes: int) -> None:
        self.block_bytes = round_up(block_bytes)
        self._readers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nvme-read")
        self._writers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nvme-write")
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

    def _run(self, pool: ThreadPoolExecutor, fn, fd: int, view: memoryview, offset: int) -> None:
        futures = [pool.submit(fn, fd, block, at) for block, at in self._blocks(view, offset)]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def write(self, fd: int, view: memoryview, offset: int) -> None:
        self._check_fault()
        self._run(self._writers, self._write_block, fd, view, offset)

    def read(self, fd: int, view: memoryview, offset: int) -> None:
        self._run(self._readers, self._read_block, fd, view, offset)

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)


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
