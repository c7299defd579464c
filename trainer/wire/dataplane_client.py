"""The trainer's end of a daemon's TCP data plane (ps_daemon/dataplane/server.py says why it
exists). A pull `recv_into`s the shard straight into the caller's buffer (the model's flat
parameters); a push `sendall`s straight from the gradient buffer (or the compressed payload).

Failures raise DataPlaneError, which looks like a grpc.RpcError (`code()`, `details()`), so
ShardedClient retries and reports them exactly as it does gRPC calls. A connection that
failed mid-request is closed, never reused.
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import ssl
from collections.abc import Iterator

import grpc

from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import FrameError, recv_exact_into, recv_message, send_message, send_payload
from ps_offload.proto.pull import Pull, PullStreamError, check_pull_header
from ps_offload.proto.push import Push
from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.wire.transport import PullInto

STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
"""DataResponse.code (a grpc.StatusCode's number) back to the status."""


class DataPlaneError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _fail_when_silent(sock: socket.socket, seconds: float) -> None:
    """A connection whose peer stops answering without a reset (a partition) fails with
    ETIMEDOUT within about `seconds`: keepalive probes from half of it while idle (a pull
    waiting for its version sends nothing), and a user timeout on unacknowledged data."""
    half = max(1, int(seconds / 2))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, half)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, half)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))


class DataPlaneClient:
    """Up to `max_connections` persistent connections to one daemon's data plane."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int,
        security: ClientSecurity | None = None,
        dead_peer_seconds: float = 10.0,
    ) -> None:
        self.address = (host, port)
        self._dead_peer_seconds = dead_peer_seconds
        self._idle: queue.LifoQueue[socket.socket] = queue.LifoQueue()
        self._max = max_connections
        security = security or ClientSecurity()
        # The daemon's data plane speaks TLS exactly when its gRPC port does (same certificate).
        self._tls = security.ssl_context()
        self._server_name = security.server_name or host
        token = security.token()
        self._authorization = f"Bearer {token}" if token else ""

    @contextlib.contextmanager
    def _connection(self, timeout: float) -> Iterator[socket.socket]:
        sock = None
        while sock is None:
            try:
                sock = self._idle.get_nowait()
            except queue.Empty:
                sock = self._connect(timeout)
                break
            if select.select([sock], [], [], 0)[0]:
                # Readable while idle: the daemon closed it (data_idle_seconds) or is about to;
                # a pooled connection never has anything to read between requests.
                sock.close()
                sock = None
        sock.settimeout(timeout)
        try:
            yield sock
        except _StatusFromDaemon as status:
            if status.closing:  # the daemon closes it after this answer: never sent on again
                sock.close()
            else:
                self._release(sock)  # a complete answer: the stream is still in step
            raise
        except (FrameError, OSError) as exc:
            sock.close()
            # The call's own timeout (socket.timeout: no errno) is a deadline; ETIMEDOUT from
            # the keepalive or the user timeout below is a peer gone silent: retried.
            expired = isinstance(exc, TimeoutError) and exc.errno is None
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.UNAVAILABLE
            raise DataPlaneError(code, f"data plane {self.address[0]}:{self.address[1]}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        self._release(sock)

    def _release(self, sock: socket.socket) -> None:
        if self._idle.qsize() < self._max:
            self._idle.put(sock)
        else:
            sock.close()

    def _connect(self, timeout: float) -> socket.socket:
        try:
            # A SYN unanswered for dead_peer_seconds is a peer gone (retried, then given up on),
            # not a wait for the call's whole timeout; the TLS handshake is bounded alike.
            sock = socket.create_connection(self.address, timeout=min(timeout, self._dead_peer_seconds))
        except OSError as exc:
            raise DataPlaneError(
                grpc.StatusCode.UNAVAILABLE, f"cannot reach data plane {self.address[0]}:{self.address[1]}: {exc}"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _fail_when_silent(sock, self._dead_peer_seconds)
        if self._tls is None:
            return sock
        try:
            return self._tls.wrap_socket(sock, server_hostname=self._server_name)
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            raise DataPlaneError(
                grpc.StatusCode.UNAVAILABLE,
                f"TLS handshake with data plane {self.address[0]}:{self.address[1]} failed: {exc}",
            ) from None

    @staticmethod
    def _answer(sock: socket.socket) -> ps_pb2.DataResponse:
        response = recv_message(sock, ps_pb2.DataResponse)
        if response.code:
            raise _StatusFromDaemon(response.code, response.message, response.closing)
        return response

    def pull_into(self, pull: Pull, *, out: memoryview, timeout: float) -> int:
        request = pull_request(pull.request, timeout, self._authorization)
        shard_id, dtype = pull.shard_id, pull.dtype
        with _daemon_status(), self._connection(timeout + 5.0) as sock:
            send_message(sock, request)
            header = self._answer(sock).shard
            try:
                check_pull_header(header, len(out), dtype, f"shard {shard_id}")
            except PullStreamError as exc:
                # Read and drop nothing: close the connection, the plan is wrong.
                raise FrameError(str(exc)) from None
            recv_exact_into(sock, out)
            return header.version

    def push(self, push: Push, *, timeout: float, pull_into: PullInto | None = None) -> ps_pb2.PushResponse:
        """Sends the header; the daemon asks for the payload unless it applied this
        (shard, step) before, and takes it with its length (ps_offload.proto.frames).
        `pull_into`: not over TCP; the answer's `pulled` stays false."""
        with _daemon_status(), self._connection(timeout) as sock:
            send_message(sock, ps_pb2.DataRequest(push=push.header, authorization=self._authorization))
            response = self._answer(sock)
            if not response.send_payload:
                return response.push  # applied before: the daemon needs no payload
            send_payload(sock, push.data)
            return self._answer(sock).push

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().close()


def pull_request(pull: ps_pb2.PullRequest, timeout: float, authorization: str) -> ps_pb2.DataRequest:
    """A data plane's (or the local transport's) pull: it may wait `timeout` for its version."""
    return ps_pb2.DataRequest(pull=pull, timeout_ms=max(1, int(timeout * 1000)), authorization=authorization)


class _StatusFromDaemon(Exception):
    """A status the daemon answered with; the connection stays usable."""

    def __init__(self, code: int, message: str, closing: bool = False) -> None:
        self.code = STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN)
        self.message = message
        self.closing = closing


@contextlib.contextmanager
def _daemon_status() -> Iterator[None]:
    try:
        yield
    except _StatusFromDaemon as status:
        raise DataPlaneError(status.code, status.message) from None
