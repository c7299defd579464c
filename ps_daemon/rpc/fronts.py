"""What the daemon's fronts say about their clients, for Admin.Stats and the metrics: which
path each client moves its bytes over (`ps-admin stats`), and the local transport's pool.

The fronts are the gRPC servicer (Pull and Push calls, by address, over the last minute:
gRPC does not say which connections are open), the TCP data plane (connections open now, by
address) and the local transport (connections and shared windows, by process).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from ps_offload.proto import ps_pb2

RECENT_SECONDS = 60.0


class RecentPeers:
    """The hosts that called Pull or Push over gRPC, with their calls of the last RECENT_SECONDS."""

    def __init__(self) -> None:
        self._calls: dict[str, collections.deque[float]] = {}
        self._lock = threading.Lock()

    def saw(self, peer: str) -> None:
        """`peer` as grpc gives it ("ipv4:10.0.0.2:41234"): counted by host, not by port."""
        host = peer.rpartition(":")[0] or peer
        with self._lock:
            self._calls.setdefault(host, collections.deque()).append(time.monotonic())

    def counts(self) -> dict[str, int]:
        since = time.monotonic() - RECENT_SECONDS
        with self._lock:
            for host in list(self._calls):
                calls = self._calls[host]
                while calls and calls[0] < since:
                    calls.popleft()
                if not calls:
                    del self._calls[host]
            return {host: len(calls) for host, calls in self._calls.items()}


class DataPlaneCounters(Protocol):
    """What Admin.Stats reads of the data plane (ps_offload.daemon.dataplane.server.DataPlaneServer)."""

    @property
    def connections(self) -> int: ...
    @property
    def parked_pulls(self) -> int: ...
    @property
    def refused(self) -> int: ...
    def peers(self) -> dict[str, int]: ...


class LocalCounters(Protocol):
    """What it reads of the local transport (ps_offload.daemon.dataplane.local_server.LocalServer)."""

    @property
    def connections(self) -> int: ...
    @property
    def refused(self) -> int: ...
    @property
    def pool_bytes(self) -> int: ...
    @property
    def pool_bytes_used(self) -> int: ...
    def processes(self) -> list[tuple[int, int, int]]: ...


class CallCounters(Protocol):
    """What it reads of the gRPC calls' bounds (ps_offload.daemon.rpc.call_bounds.CallBounds)."""

    @property
    def refused(self) -> int: ...
    @property
    def cancelled(self) -> int: ...


@dataclass(frozen=True)
class Fronts:
    grpc_peers: RecentPeers
    data_plane: DataPlaneCounters | None = None
    local: LocalCounters | None = None
    calls: CallCounters | None = None

    def client_paths(self) -> list[ps_pb2.ClientPath]:
        paths = [
            ps_pb2.ClientPath(client=f"pid {pid}", transport="local", connections=n, shared_bytes=nbytes)
            for pid, n, nbytes in (self.local.processes() if self.local else [])
        ]
        if self.data_plane is not None:
            paths += [
                ps_pb2.ClientPath(client=peer, transport="data", connections=n)
                for peer, n in sorted(self.data_plane.peers().items())
            ]
        paths += [
            ps_pb2.ClientPath(client=peer, transport="grpc", connections=n)
            for peer, n in sorted(self.grpc_peers.counts().items())
        ]
        return paths

    def stats(self) -> dict:
        """The StatsResponse fields of the fronts."""
        plane, local = self.data_plane, self.local
        return dict(
            data_connections=plane.connections if plane else 0,
            data_pulls_waiting=plane.parked_pulls if plane else 0,
            data_connections_refused=plane.refused if plane else 0,
            local_connections=local.connections if local else 0,
            local_connections_refused=local.refused if local else 0,
            local_pool_bytes=local.pool_bytes if local else 0,
            local_pool_bytes_used=local.pool_bytes_used if local else 0,
            clients=self.client_paths(),
        )
