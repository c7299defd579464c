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
* At most `server.max_waiting_pulls_per_client` of them from one client address (default
  half of max_waiting_pulls), so one host in a loop cannot take every waiting slot from the
  others. The address is the identity: every process on a host shares the budget (the
  shared token names no one, and it is what the data plane's limits count by too).
* A waiting pull whose caller cancels or passes its deadline is woken by gRPC's callback for
  the call's end and gives its thread back at once, instead of waiting out its timeout.

The TCP data plane parks its waiting pulls without a thread (ps_offload.daemon.dataplane.server) and takes
none of these; its connection limits, total and per address, bound them.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ps_offload.daemon.errors import ResourceExhausted

if TYPE_CHECKING:  # the store imports this module, and loads no gRPC (tests/test_layering.py)
    import grpc


def client_address(peer: str) -> str:
    """The address in gRPC's peer string ("ipv4:10.0.0.5:41234", "ipv6:[::1]:41234"), or the
    whole string for another kind of peer."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return rest.rpartition(":")[0].strip("[]")


class PullWaits:
    """The count of gRPC pulls waiting for a version, against `limit` in all and `per_client`
    from one client address."""

    def __init__(self, limit: int, per_client: int | None = None) -> None:
        self.limit = limit
        self.per_client = per_client if per_client else max(limit // 2, 1)
        self.waiting = 0
        self.refused = 0
        self._by_client: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def for_call(self, context: grpc.ServicerContext) -> PullWait:
        return PullWait(self, context)

    @contextlib.contextmanager
    def admitted(self, client: str) -> Iterator[None]:
        with self._lock:
            refusal = self._refusal_locked(client)
            if refusal is not None:
                self.refused += 1
                raise ResourceExhausted(refusal)
            self.waiting += 1
            self._by_client[client] += 1
        try:
            yield
        finally:
            with self._lock:
                self.waiting -= 1
                self._by_client[client] -= 1
                if not self._by_client[client]:
                    del self._by_client[client]

    def _refusal_locked(self, client: str) -> str | None:
        if self.waiting >= self.limit:
            return (
                f"{self.waiting} pulls are already waiting for versions not pushed yet (server.max_waiting_pulls "
                f"= {self.limit}): retry later, pull versions that exist, or raise server.max_waiting_pulls "
                "(with server.max_workers)"
            )
        if self._by_client[client] >= self.per_client:
            return (
                f"{client} has {self.per_client} pulls waiting for versions not pushed yet "
                f"(server.max_waiting_pulls_per_client = {self.per_client}, shared by every process on that host): "
                "retry later, pull versions that exist, use the TCP data plane (its waiting pulls hold no thread), "
                "or raise server.max_waiting_pulls_per_client"
            )
        return None


class PullWait:
    """One gRPC pull's wait: admitted by its PullWaits, and ended when its call ends."""

    def __init__(self, waits: PullWaits, context: grpc.ServicerContext) -> None:
        self.waits = waits
        self.client = client_address(context.peer())
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
        with self.waits.admitted(self.client):
            with self._lock:
                self._cond = cond
            try:
                yield
            finally:
                with self._lock:
                    self._cond = None
