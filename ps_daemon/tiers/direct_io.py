"""O_DIRECT I/O for the NVMe tier (ps_offload.daemon.tiers.nvme): page-aligned buffers, positional
reads and writes split into blocks with several in flight, and the injected write errors the
tests use in place of a full or failing disk. Nothing here knows shards or slots."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from ps_offload.daemon.tiers.tier import round_up

T = TypeVar("T")


class DirectIO:
    """Positional reads and writes with O_DIRECT, split into blocks with several in flight
    (os.preadv/pwritev release the GIL). Reads and writes have queues and threads of their
    own (`threads` writers, `read_threads` readers, as many by default): a swap-in that a
    pull waits for never queues behind the write-back of other shards."""

    def __init__(self, *, threads: int, block_bytes: int, read_threads: int | None = None) -> None:
        self.block_bytes = round_up(block_bytes)
        readers = threads if read_threads is None else read_threads
        self._readers = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="nvme-read")
        self.read_depth_bytes = readers * self.block_bytes
        """The bytes the readers have in flight when all are busy: what a prefetch keeps
        loading at once (ps_offload.daemon.tiers.ram) to keep the disk as busy as a single large read."""
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

    def _submit(
        self, pool: ThreadPoolExecutor, fn, fd: int, view: memoryview, offset: int
    ) -> list[tuple[memoryview, Future]]:
        return [(block, pool.submit(fn, fd, block, at)) for block, at in self._blocks(view, offset)]

    @staticmethod
    def _wait(futures: list[tuple[memoryview, Future]], on_block: Callable[[memoryview], None] | None = None) -> None:
        """Waits for every block (the buffer is the caller's again only then), in order, giving
        each to `on_block` once it is done; raises the first error after all have ended."""
        first: BaseException | None = None
        for block, future in futures:
            error = future.exception()
            first = first or error
            if first is None and on_block is not None:
                try:
                    on_block(block)
                except BaseException as exc:  # still wait for the rest
                    first = exc
        if first is not None:
            raise first

    def write(self, fd: int, view: memoryview, offset: int, meanwhile: Callable[[], T] | None = None) -> T | None:
        """Writes `view` at `offset`; `meanwhile()`, if given, runs in the calling thread while
        the blocks are written (a commit's checksums), and its answer is returned."""
        self._check_fault()
        futures = self._submit(self._writers, self._write_block, fd, view, offset)
        result, error = None, None
        try:
            result = meanwhile() if meanwhile is not None else None
        except BaseException as exc:
            error = exc
        self._wait(futures)
        if error is not None:
            raise error
        return result

    def write_parts(
        self, fd: int, parts: list[tuple[memoryview, int]], meanwhile: Callable[[], T] | None = None
    ) -> tuple[T | None, list[BaseException | None]]:
        """Writes each (view, offset) of `parts`, every block of all of them queued at once (a
        group commit's arenas: the disk sees the whole group in flight, not one arena after
        another), `meanwhile()` running in the calling thread as they are written. Returns its
        answer and each part's error (None: written); raises only `meanwhile`'s own error,
        after every block has ended."""
        submitted: list[list[tuple[memoryview, Future]] | BaseException] = []
        for view, offset in parts:
            try:
                self._check_fault()  # one write per part, as `write` counts
                submitted.append(self._submit(self._writers, self._write_block, fd, view, offset))
            except Exception as exc:  # noqa: BLE001 - this part's error; the others still run
                submitted.append(exc)
        result, error = None, None
        try:
            result = meanwhile() if meanwhile is not None else None
        except BaseException as exc:
            error = exc
        errors: list[BaseException | None] = []
        for futures in submitted:
            if isinstance(futures, BaseException):
                errors.append(futures)
                continue
            try:
                self._wait(futures)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - every part is waited for, whatever one raised
                errors.append(exc)
        if error is not None:
            raise error
        return result, errors

    def read(
        self, fd: int, view: memoryview, offset: int, on_block: Callable[[memoryview], None] | None = None
    ) -> None:
        """Reads `view` from `offset`; `on_block(block)`, if given, runs in the calling thread on
        each block in order as soon as it and those before it have landed (a load's crc32c,
        folded while later blocks are still being read)."""
        self._wait(self._submit(self._readers, self._read_block, fd, view, offset), on_block)

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
