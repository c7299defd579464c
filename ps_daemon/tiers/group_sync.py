"""Group commit for one file: commits that run at once share their fdatasyncs.

Each commit of a shard syncs twice (its bytes, then its header; ps_offload.daemon.tiers.nvme).
Shards committed together (pushes of several shards arriving at once, from several ranks or
streams) would sync one after another, each waiting for the disk's flush in turn, where
one flush covers every write that finished before it began. `GroupSync.sync()` returns once
an fdatasync that began after the call has completed: the first caller runs it, the callers
that arrive meanwhile wait and share the next one. No commit returns before a flush that
covers its writes, so "a committed version is never lost" holds exactly as with a sync per
commit (the crash tests and the kill soak run against it).

A flush that fails fails every commit it was to cover: after a failed fdatasync Linux may
have dropped the dirty pages, so a later successful one proves nothing for them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable


class GroupSync:
    def __init__(
        self, fd: int, flush: Callable[[int], None] = os.fdatasync, on_flush: Callable[[float], None] | None = None
    ) -> None:
        self.fd = fd
        self._flush = flush
        self._on_flush = on_flush  # given each flush's seconds, once it returned (the daemon's totals)
        self._cond = threading.Condition()
        self._started = 0  # flushes begun, numbered from 1
        self._finished = 0  # the newest flush done (they run one at a time, in order)
        self._running = False
        self._failed: dict[int, OSError] = {}  # by flush number
        self.flushes = 0  # flushes run (for stats and tests)
        self.calls = 0  # sync() calls
        self.seconds = 0.0  # spent in flushes

    def sync(self) -> None:
        """Returns once a flush begun after this call has completed; raises its error if it
        failed."""
        with self._cond:
            self.calls += 1
            needed = self._started + 1  # the one running (if any) may have begun before our writes
            while self._finished < needed:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                self._started += 1
                number = self._started
                self._cond.release()
                error: OSError | None = OSError(0, "interrupted")  # until the flush returns
                started = time.perf_counter()
                try:
                    self._flush(self.fd)
                    error = None
                except OSError as exc:
                    error = exc
                finally:
                    self._cond.acquire()
                    took = time.perf_counter() - started
                    self.seconds += took
                    if self._on_flush is not None:
                        self._on_flush(took)
                    self._running = False
                    self._finished = number
                    self.flushes += 1
                    if error is not None:
                        self._failed[number] = error
                    self._cond.notify_all()
            error = self._failed.get(needed)  # kept: failures are rare, and a late waiter needs its own
        if error is not None:
            raise OSError(error.errno, f"fdatasync failed: {error.strerror}") from error
