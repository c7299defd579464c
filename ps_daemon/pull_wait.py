"""Pulls waiting for a version: how many may wait at once, and an end to a wait whose caller
has gone.

A Pull asks for a version at least `min_version`; until a push makes it, the pull waits, and
on the gRPC port a waiting call holds one of the server's `max_workers` threads. Unbounded,
enough waiting pulls (a trainer asking for a step no one pushes, or a client in a loop) take
every thread: health checks queue behind them, so the systemd watchdog kills a daemon that
is fine. So:

* At most `server.max_waiting_pulls` gRPC pulls wait at once (default: half the threads,
  leaving the rest for pushes, admin calls and health checks); one more is answered
  RESOURCE_EXHAUSTED at once, saying which limit and how to raise it. A pull that need not
  wait (its version is there) is never refused.
* A waiting pull whose caller cancels or passes its deadline is woken by gRPC's callback for
  the call's end and gives its thread back at once, instead of waiting out its timeout.

The TCP data plane's pulls wait on their connection's own thread and take neither (its
connections are bounded separately).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ps_offload.daemon.errors import ResourceExhausted

if TYPE_CHECKING:  # the store imports this module, and loads no gRPC (tests/test_layering.py)
    import grpc


class PullWaits:
    """The count of gRPC pulls waiting for a version, against `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting = 0
        self.refused = 0
        self._lock = threading.Lock()

    def for_call(self, context: grpc.ServicerContext) -> PullWait:
        return PullWait(self, context)

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        with self._lock:
            if self.waiting >= self.limit:
                self.refused += 1
                raise ResourceExhausted(
                    f"{self.waiting} pulls are already waiting for versions not pushed yet (server.max_waiting_pulls "
                    f"= {self.limit}): retry later, pull versions that exist, or raise server.max_waiting_pulls "
                    "(with server.max_workers)"
                )
            self.waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self.waiting -= 1


class PullWait:
    """One gRPC pull's wait: admitted by its PullWaits, and ended when its call ends."""

    def __init__(self, waits: PullWaits, context: grpc.ServicerContext) -> None:
        self.waits = waits
        self.ended = False
        self._cond: threading.Condition | None = None
        self._lock = threading.Lock()
        if not context.add_callback(self._on_end):  # the call has ended already
            self.ended = True

    def _on_end(self) -> None:
        """gRPC's callback when the call ends (cancelled, past its deadline, or answered)."""
        with self._lock:
            self.ended = True
            cond = self._cond
        if cond is not None:
            with cond:
                cond.notify_all()

    @contextlib.contextmanager
    def parked(self, cond: threading.Condition) -> Iterator[None]:
        """Around a wait on `cond` (entered with `cond` held): admitted or refused, and woken
        through `cond` when the call ends."""
        with self.waits.admitted():
            with self._lock:
                self._cond = cond
            try:
                yield
            finally:
                with self._lock:
                    self._cond = None
