"""The daemon's TCP data plane: Pull and Push without gRPC's copies.

gRPC Python copies a streamed payload about four times on its way (the serializer must
return bytes, the core copies them, the receiver gets a fresh bytes per message); at
1-2 GB/s that is half of what loopback carries (docs/benchmarks.md). Here a pull is one
`sendall` straight from the shard's master tensor, which the trainer `recv_into`s straight
into its parameters, and a push lands with `recv_into` in a staging buffer. gRPC keeps
everything else: registration, health, admin, and the same Pull/Push as a fallback.

Each connection is served by one thread, one request at a time (the trainer opens a few per
daemon). At most `server.max_data_connections` are open at once (one more is answered
RESOURCE_EXHAUSTED and closed), and one idle for `server.data_idle_seconds` (no next request,
or a request stalled midway) is closed, giving its thread back; the trainer's client
reconnects unseen (trainer/dataplane.py checks a pooled connection before reusing it).
Requests go through the same store calls and the same validation as the gRPC servicer
(ps_daemon.wire), and errors come back as the same status codes and messages. With [tls] the
connection is TLS with the gRPC port's certificate (and client certificates under mutual
TLS), the handshake done in the connection's thread; with auth.require_token = "all"
every request carries the token, checked as gRPC's interceptor checks it (ps_daemon.security).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from ps_offload.daemon import wire
from ps_offload.daemon.buffers import StagingPool
from ps_offload.daemon.errors import InvalidArgument, PsError
from ps_offload.daemon.rpc_errors import from_status, status_of
from ps_offload.daemon.security import TokenCheck
from ps_offload.daemon.store import ShardStore
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import FrameError, recv_exact_into, recv_message, send_message

log = logging.getLogger(__name__)


class _Handler(socketserver.BaseRequestHandler):
    server: DataPlaneServer

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The socket stop() shuts down: after a TLS wrap that is the wrapped one (wrapping
        # detaches the plain socket from its descriptor).
        self.secured: socket.socket | None = self.request
        if not self.server.track(self.request, add=True):
            self._refuse_over_limit()
            return
        # Idle past this (no next request, or a request or answer stalled midway): closed,
        # giving its thread back. A trainer's client reconnects unseen.
        self.request.settimeout(self.server.idle_seconds)
        if self.server.tls is None:
            return
        self.request.settimeout(30.0)  # a client that never finishes the handshake
        try:
            self.secured = self.server.tls.wrap_socket(self.request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.info("data plane: TLS handshake with %s failed: %s", self.client_address, exc)
            self.secured = None
        finally:
            self.server.track(self.request, add=False)
        if self.secured is not None:
            self.secured.settimeout(self.server.idle_seconds)
            self.server.track(self.secured, add=True, force=True)

    def _refuse_over_limit(self) -> None:
        """One connection past server.max_data_connections: its first request is answered
        RESOURCE_EXHAUSTED, naming the limit, and the connection closed."""
        limit = self.server.max_connections
        message = (
            f"the data plane has {limit} connections open (server.max_data_connections = {limit}): close idle "
            "connections, or raise server.max_data_connections"
        )
        log.info("data plane: refused a connection from %s: %s", self.client_address, message)
        try:
            if self.server.tls is None:  # (under TLS the handshake would come first: just close)
                self.request.settimeout(5.0)
                send_message(self.request, ps_pb2.DataResponse(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                                               message=message))  # fmt: skip
        except OSError:
            pass
        self.secured = None

    def finish(self) -> None:
        if self.secured is not None:
            self.server.track(self.secured, add=False)

    def handle(self) -> None:
        sock = self.secured
        if sock is None:
            return
        while not self.server.stopping:
            try:
                request = recv_message(sock, ps_pb2.DataRequest)
            except (FrameError, OSError):
                return  # hung up (or shut down while idle), or not speaking this protocol
            with self.server.in_flight(), self._timed(request):
                try:
                    in_sync = self._serve(sock, request)
                except PsError as exc:
                    self.code = status_of(exc)
                    in_sync = True
                    try:
                        send_message(sock, ps_pb2.DataResponse(code=self.code.value[0], message=str(exc)))
                    except OSError:
                        return
                except (FrameError, OSError) as exc:
                    self.code = grpc.StatusCode.UNAVAILABLE
                    log.info("data plane: connection from %s dropped: %s", self.client_address, exc)
                    return
                except Exception as exc:  # noqa: BLE001 - answered, logged, connection closed
                    self.code = grpc.StatusCode.INTERNAL
                    log.exception("data plane request failed")
                    message = f"internal error: {type(exc).__name__}: {exc}"
                    send_message(sock, ps_pb2.DataResponse(code=self.code.value[0], message=message))
                    return
            if not in_sync:
                return

    @contextlib.contextmanager
    def _timed(self, request: ps_pb2.DataRequest) -> Iterator[None]:
        """Reports the request's time and outcome (self.code) to server.observe, if any."""
        self.code, started = grpc.StatusCode.OK, time.perf_counter()
        try:
            yield
        finally:
            kind = request.WhichOneof("kind")
            if self.server.observe is not None and kind in _METHODS:
                self.server.observe(f"DataPlane/{kind.capitalize()}", self.code, time.perf_counter() - started)

    def _serve(self, sock: socket.socket, request: ps_pb2.DataRequest) -> bool:
        """Answers one request; returns False when the stream can no longer be trusted."""
        store, kind = self.server.store, request.WhichOneof("kind")
        if kind in _METHODS and self.server.token is not None:
            refusal = self.server.token.refusal(_METHODS[kind], request.authorization or None)
            if refusal is not None:
                raise from_status(*refusal)
        if kind == "pull":
            cap = self.server.max_pull_wait
            timeout = min(request.timeout_ms / 1000, cap) if request.timeout_ms else cap
            with wire.pull_bytes(store, request.pull, timeout=timeout, staging=self.server.staging) as (header, raw):
                send_message(sock, ps_pb2.DataResponse(shard=header))
                # Still held: the bytes sent are one version, never half an update.
                sock.sendall(raw)
            return True
        if kind == "push":
            push = wire.push_request(request.push)
            duplicate = wire.open_push(store, push)
            if duplicate is not None:
                send_message(sock, ps_pb2.DataResponse(push=duplicate))
                return True
            send_message(sock, ps_pb2.DataResponse(send_payload=True))
            with self.server.staging.borrow(wire.staging_numel(push)) as staging:
                recv_exact_into(sock, memoryview(staging.numpy()).cast("B")[: push.nbytes])
                response = wire.apply_push(store, push, staging, self.server.staging)
                send_message(sock, ps_pb2.DataResponse(push=response))
            return True
        raise InvalidArgument("a DataRequest must carry a pull or a push")


# The gRPC method each data plane request stands for (the token rule is the same).
_METHODS = {"pull": "/ps.v1.ParameterServer/Pull", "push": "/ps.v1.ParameterServer/Push"}


class DataPlaneServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        store: ShardStore,
        staging: StagingPool,
        max_pull_wait: float,
        tls: ssl.SSLContext | None = None,
        token: TokenCheck | None = None,
        observe: Callable[[str, grpc.StatusCode, float], None] | None = None,
        max_connections: int = 1024,
        idle_seconds: float = 300.0,
    ) -> None:
        """tls: wrap connections (ps_daemon.security.server_ssl_context); token: the [auth]
        rule; observe(method, code, seconds): told about every request (metrics);
        max_connections: open at once (one more is refused); idle_seconds: a connection
        with nothing to read or write for this long is closed."""
        super().__init__(address, _Handler)
        self.max_connections = max_connections
        self.idle_seconds = idle_seconds
        self.store = store
        self.staging = staging
        self.max_pull_wait = max_pull_wait
        self.tls = tls
        self.token = token
        self.observe = observe
        self.stopping = False
        self._connections: set[socket.socket] = set()
        self._busy = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="data-plane", daemon=True)
        self._thread.start()

    def track(self, sock: socket.socket, *, add: bool, force: bool = False) -> bool:
        """Adds (unless max_connections are open, or `force`) or removes a connection;
        returns whether it is tracked now (or was removed)."""
        with self._cond:
            if not add:
                self._connections.discard(sock)
                return True
            if len(self._connections) >= self.max_connections and not force:
                return False
            self._connections.add(sock)
            return True

    def in_flight(self) -> _InFlight:
        return _InFlight(self)

    def stop(self, grace: float) -> None:
        """Stops accepting, lets requests in progress finish for up to `grace` seconds, then
        closes every connection (idle ones at once)."""
        self.stopping = True
        self.shutdown()
        self.server_close()
        deadline = time.monotonic() + grace
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0, timeout=max(0.0, deadline - time.monotonic()))
            for sock in self._connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _InFlight:
    def __init__(self, server: DataPlaneServer) -> None:
        self.server = server

    def __enter__(self) -> None:
        with self.server._cond:
            self.server._busy += 1

    def __exit__(self, *exc: object) -> None:
        with self.server._cond:
            self.server._busy -= 1
            self.server._cond.notify_all()
