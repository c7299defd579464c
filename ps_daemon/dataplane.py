"""The daemon's TCP data plane: Pull and Push without gRPC's copies.

gRPC Python copies a streamed payload about four times on its way (the serializer must
return bytes, the core copies them, the receiver gets a fresh bytes per message); at
1-2 GB/s that is half of what loopback carries (docs/benchmarks.md). Here a pull is one
`sendall` straight from the shard's master tensor, which the trainer `recv_into`s straight
into its parameters, and a push lands with `recv_into` in a staging buffer. gRPC keeps
everything else: registration, health, admin, and the same Pull/Push as a fallback.

Each connection is served by one thread, one request at a time (the trainer opens a few per
daemon). Requests go through the same store calls and the same validation as the gRPC
servicer (ps_daemon.wire), and errors come back as the same status codes and messages.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time

from ps_daemon import wire
from ps_daemon.buffers import StagingPool
from ps_daemon.errors import InvalidArgument, PsError
from ps_daemon.store import ShardStore
from ps_proto import ps_pb2
from ps_proto.frames import FrameError, recv_exact_into, recv_message, send_message

log = logging.getLogger(__name__)


class _Handler(socketserver.BaseRequestHandler):
    server: DataPlaneServer

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.request, add=True)

    def finish(self) -> None:
        self.server.track(self.request, add=False)

    def handle(self) -> None:
        sock: socket.socket = self.request
        while not self.server.stopping:
            try:
                request = recv_message(sock, ps_pb2.DataRequest)
            except (FrameError, OSError):
                return  # hung up (or shut down while idle), or not speaking this protocol
            with self.server.in_flight():
                try:
                    in_sync = self._serve(sock, request)
                except PsError as exc:
                    in_sync = True
                    try:
                        send_message(sock, ps_pb2.DataResponse(code=exc.code.value[0], message=str(exc)))
                    except OSError:
                        return
                except (FrameError, OSError) as exc:
                    log.info("data plane: connection from %s dropped: %s", self.client_address, exc)
                    return
                except Exception as exc:  # noqa: BLE001 - answered, logged, connection closed
                    log.exception("data plane request failed")
                    message = f"internal error: {type(exc).__name__}: {exc}"
                    send_message(sock, ps_pb2.DataResponse(code=PsError.code.value[0], message=message))
                    return
            if not in_sync:
                return

    def _serve(self, sock: socket.socket, request: ps_pb2.DataRequest) -> bool:
        """Answers one request; returns False when the stream can no longer be trusted."""
        store, kind = self.server.store, request.WhichOneof("kind")
        if kind == "pull":
            pull = request.pull
            cap = self.server.max_pull_wait
            timeout = min(request.timeout_ms / 1000, cap) if request.timeout_ms else cap
            held = store.pull(
                pull.model, pull.shard_id, min_version=pull.min_version, timeout=timeout, tensor=wire.pull_tensor(pull)
            )
            with held as (tensor, version):
                header = wire.shard_header(pull.model, pull.shard_id, version, tensor.numel())
                send_message(sock, ps_pb2.DataResponse(shard=header))
                # Under the read hold: the bytes sent are one version, never half an update.
                sock.sendall(memoryview(tensor.numpy()).cast("B"))
            return True
        if kind == "push":
            header = request.push
            duplicate = wire.open_push(store, header)
            if duplicate is not None:
                send_message(sock, ps_pb2.DataResponse(push=duplicate))
                return True
            send_message(sock, ps_pb2.DataResponse(send_payload=True))
            with self.server.staging.borrow(wire.staging_numel(header)) as staging:
                recv_exact_into(sock, memoryview(staging.numpy()).cast("B")[: header.nbytes])
                response = wire.apply_push(store, header, staging, self.server.staging)
                send_message(sock, ps_pb2.DataResponse(push=response))
            return True
        raise InvalidArgument("a DataRequest must carry a pull or a push")


class DataPlaneServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], *, store: ShardStore, staging: StagingPool, max_pull_wait: float
    ) -> None:
        super().__init__(address, _Handler)
        self.store = store
        self.staging = staging
        self.max_pull_wait = max_pull_wait
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

    def track(self, sock: socket.socket, *, add: bool) -> None:
        with self._cond:
            (self._connections.add if add else self._connections.discard)(sock)

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
