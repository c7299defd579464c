"""Who may hold a data plane connection (ps_offload.daemon.dataplane.server): the limits checked at accept,
before any work, and the connection's own state."""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import socket
from collections.abc import Iterator

import grpc

from ps_offload.daemon.dataplane.requests import PendingPull
from ps_offload.daemon.rpc.status import RateLimitedLog
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import recv_exact_into, send_message

log = logging.getLogger(__name__)

# The data plane's log of refusals and closed connections: a client connecting or sending
# garbage in a loop must not fill the log.
quiet_log = RateLimitedLog()


class Connection:
    """One client connection. Its fields change on the selector thread, or on the one worker
    the connection is handed to (never both at once)."""

    def __init__(self, sock: socket.socket, peer: str, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.inbox = bytearray()  # bytes read, not yet taken by a request
        self.last_active = now
        self.handshaking = False
        self.busy = False  # with a worker
        self.parked: PendingPull | None = None
        self.watched = 0  # the selector events it is registered for
        self.closed = False

    def recv_exact_into(self, view: memoryview) -> None:
        """Fills `view`: first from the bytes read ahead with the request, then the socket."""
        ahead = min(len(self.inbox), len(view))
        if ahead:
            view[:ahead] = self.inbox[:ahead]
            del self.inbox[:ahead]
        if ahead < len(view):
            recv_exact_into(self.sock, view[ahead:])


class Admission:
    """The connections open, by peer address, against `server.max_data_connections` and
    `server.max_data_connections_per_client`. Used on the selector thread only."""

    def __init__(self, max_connections: int, max_per_client: int, *, tls: bool) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.tls = tls
        self.connections: set[Connection] = set()
        self.refused = 0  # since the start
        self._per_peer: collections.Counter[str] = collections.Counter()

    def admit(self, sock: socket.socket, peer: str) -> bool:
        """Whether a new connection from `peer` may stay. One that may not has its first
        request answered RESOURCE_EXHAUSTED, naming the limit (it is small: the socket buffer
        takes it at once; under TLS the handshake would come first, so it is just closed),
        and is closed."""
        refusal = self._over_limit(peer)
        if refusal is None:
            return True
        self.refused += 1
        quiet_log.info("DataPlane", "RESOURCE_EXHAUSTED", f"refused a connection from {peer}: {refusal}")
        try:
            if not self.tls:
                sock.setblocking(False)
                code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                send_message(sock, ps_pb2.DataResponse(code=code, message=refusal))
        except OSError:
            pass
        sock.close()
        return False

    def peers(self) -> dict[str, int]:
        """Connections open now, by address (read from any thread: a dict copy is atomic)."""
        return dict(self._per_peer)

    def opened(self, conn: Connection) -> None:
        self.connections.add(conn)
        self._per_peer[conn.peer] += 1

    def closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self._per_peer[conn.peer] -= 1
        if not self._per_peer[conn.peer]:
            del self._per_peer[conn.peer]

    def _over_limit(self, peer: str) -> str | None:
        if len(self.connections) >= self.max_connections:
            limit = self.max_connections
            return (
                f"the data plane has {limit} connections open (server.max_data_connections = {limit}): close idle "
                "connections, or raise server.max_data_connections"
            )
        if self._per_peer[peer] >= self.max_per_client:
            limit = self.max_per_client
            return (
                f"{peer} has {limit} data plane connections open (server.max_data_connections_per_client = {limit}, "
                "shared by every process on that host): close idle ones, or raise the limit"
            )
        return None


class Waker:
    """Wakes the selector thread from any thread: a byte on a socket pair it watches."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)

    def wake(self) -> None:
        try:
            self._writer.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake is pending already (or the server is gone)

    def drain(self) -> None:
        try:
            while self.reader.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass


class ParkedDeadlines:
    """The deadlines of parked pulls, soonest first. A pull woken early leaves its entry
    behind (removing it from a heap costs more than skipping it later)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Connection, PendingPull]] = []
        self._order = itertools.count()  # ties: no comparing connections

    def add(self, conn: Connection, pending: PendingPull, parked: int) -> None:
        """`parked`: how many pulls are parked now, to drop stale entries before they pile up."""
        if len(self._heap) > 2 * parked + 1024:
            self._heap = [entry for entry in self._heap if entry[2].parked is entry[3]]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (pending.deadline, next(self._order), conn, pending))

    def next_deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def expired(self, now: float) -> Iterator[Connection]:
        """The connections whose pull is still parked and past its deadline."""
        while self._heap and self._heap[0][0] <= now:
            _, _, conn, pending = heapq.heappop(self._heap)
            if conn.parked is pending and not conn.closed:
                yield conn
