"""One data plane request, served by a worker of the data plane's pool (ps_offload.daemon.dataplane.server).

Requests go through the same data path as the gRPC servicer (ps_offload.daemon.rpc.data_path:
receive_push, serve_pull), and errors come back as the same status codes and messages. A pull is one
`sendall` straight from the shard's master tensor (the trainer `recv_into`s it straight into
its parameters); a push's payload lands with `recv_into` in a staging buffer.

A pull whose version is not there yet does not wait on its worker: `serve` answers
`PendingPull`, the server parks it on the shard (Shard.watch) and gives the worker
back, and the pull is served again, by whichever worker is free, when the commit wakes it or
its deadline passes.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from ps_offload.daemon.errors import InvalidArgument, PsError, StreamOutOfStep
from ps_offload.daemon.rpc import conversions, data_path
from ps_offload.daemon.rpc.server_security import TokenCheck
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.rpc.status import from_status, status_of
from ps_offload.daemon.store.pull import CheckedPull
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.proto import ps_pb2
from ps_offload.proto.channel import method_path
from ps_offload.proto.frames import PAYLOAD_LENGTH, FrameError, send_message

log = logging.getLogger(__name__)

# The gRPC method each data plane request stands for (the token rule is the same).
DATA_METHODS = {"pull": method_path("ParameterServer", "Pull"), "push": method_path("ParameterServer", "Push")}
"""A DataRequest's kind -> the gRPC method it stands for (the token rule and the metrics name it so)."""


class Stream(Protocol):
    """A connection as a worker sees it: its socket (blocking, with the stall timeout) and the
    bytes read ahead of the request's payload."""

    sock: socket.socket
    peer: str

    def recv_exact_into(self, view: memoryview) -> None: ...


@dataclass
class PendingPull:
    """A pull parked until its shard reaches the version or `deadline` (time.monotonic) passes."""

    request: ps_pb2.DataRequest
    checked: CheckedPull  # request.pull, converted and checked against its shard once: what it waits on
    started: float  # time.perf_counter() when the request arrived: its observed time includes the wait
    deadline: float
    timeout: float  # seconds it may wait in all, for the message when they pass
    unwatch: Callable[[], None] | None = None  # unparks it from the shard
    woken: bool = False  # the commit it waited for has come


UNREAD_SLACK = 1 << 20
"""A refused payload's bytes read and dropped past what its header announced (a client that
sent no length at all is read as announcing its first 8 bytes)."""
UNREAD_SECONDS = 5.0


def _drop_unread(sock: socket.socket, nbytes: int) -> None:
    """After refusing a payload: says no more (FIN), then reads and drops up to `nbytes` the
    peer may still be sending, for at most UNREAD_SECONDS. Closing with them unread would
    reset the connection, and the peer would see a reset instead of the answer."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + UNREAD_SECONDS
        scratch = bytearray(1 << 16)
        while nbytes > 0 and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            got = sock.recv_into(scratch, min(nbytes, len(scratch)))
            if not got:
                return
            nbytes -= got
    except OSError:
        pass


class Outcome:
    KEEP = "keep"  # answered; the connection reads its next request
    CLOSE = "close"  # the stream cannot be trusted, or the peer is gone


class RequestServer:
    def __init__(
        self,
        *,
        store: ShardStore,
        staging: StagingPool,
        max_pull_wait: float,
        token: TokenCheck | None,
        observe: Callable[[str, grpc.StatusCode, float], None] | None,
    ) -> None:
        self.store = store
        self.staging = staging
        self.max_pull_wait = max_pull_wait
        self.token = token
        self.observe = observe

    def serve(
        self, conn: Stream, request: ps_pb2.DataRequest, started: float, resumed: PendingPull | None = None
    ) -> str | PendingPull:
        """Answers `request` (or a parked pull, `resumed`) on `conn`: an Outcome, or the
        PendingPull to park."""
        kind, code = request.WhichOneof("kind"), grpc.StatusCode.OK
        try:
            answered = self._serve(conn, request, kind, started, resumed)
            if isinstance(answered, PendingPull):
                code = None  # observed when it is answered
            return answered
        except PsError as exc:
            code = status_of(exc)
            closing = isinstance(exc, StreamOutOfStep)
            try:
                send_message(conn.sock, ps_pb2.DataResponse(code=code.value[0], message=str(exc), closing=closing))
            except OSError:
                return Outcome.CLOSE
            if closing:
                _drop_unread(conn.sock, exc.unread)
                return Outcome.CLOSE
            return Outcome.KEEP
        except (FrameError, OSError) as exc:
            code = grpc.StatusCode.UNAVAILABLE
            log.info("data plane: connection from %s dropped: %s", conn.peer, exc)
            return Outcome.CLOSE
        except Exception as exc:  # noqa: BLE001 - answered, logged, connection closed
            code = grpc.StatusCode.INTERNAL
            log.exception("data plane request failed")
            message = f"internal error: {type(exc).__name__}: {exc}"
            try:
                send_message(conn.sock, ps_pb2.DataResponse(code=code.value[0], message=message))
            except OSError:
                pass
            return Outcome.CLOSE
        finally:
            if code is not None and self.observe is not None and kind in DATA_METHODS:
                self.observe(f"DataPlane/{kind.capitalize()}", code, time.perf_counter() - started)

    def _serve(
        self, conn: Stream, request: ps_pb2.DataRequest, kind: str | None, started: float, resumed: PendingPull | None
    ) -> str | PendingPull:
        if kind in DATA_METHODS and self.token is not None and resumed is None:
            refusal = self.token.refusal(DATA_METHODS[kind], request.authorization or None)
            if refusal is not None:
                raise from_status(*refusal)
        if kind == "pull":
            return self._pull(conn, request, started, resumed)
        if kind == "push":
            return self._push(conn, request.push)
        raise InvalidArgument(
            "a DataRequest on the data plane must carry a pull or a push (a batch is for the local transport only)"
        )

    def _pull(
        self, conn: Stream, request: ps_pb2.DataRequest, started: float, resumed: PendingPull | None
    ) -> str | PendingPull:
        waited = None
        if resumed is None:
            pull = self.store.check_pull(conversions.pull_request(request.pull))
            timeout = min(request.timeout_ms / 1000, self.max_pull_wait) if request.timeout_ms else self.max_pull_wait
            if pull.must_wait():
                return PendingPull(request, pull, started, time.monotonic() + timeout, timeout)
        else:
            pull = resumed.checked
            # Woken by the commit: a writer may still hold the shard for a moment. Past the
            # deadline: one last look, and the message says how long the pull waited.
            timeout = max(resumed.deadline - time.monotonic(), 0.0)
            if not resumed.woken:
                timeout, waited = 0.0, resumed.timeout
        with data_path.serve_pull(self.store, pull, timeout=timeout, scratch=self.staging.borrow, waited=waited) as (
            header,
            raw,
        ):
            send_message(conn.sock, ps_pb2.DataResponse(shard=header))
            # Still held: the bytes sent are one version, never half an update.
            conn.sock.sendall(raw)
        return Outcome.KEEP

    def _push(self, conn: Stream, header: ps_pb2.PushHeader) -> str:
        def read_payload(view: memoryview) -> None:  # not called for a push applied before
            send_message(conn.sock, ps_pb2.DataResponse(send_payload=True))
            length = bytearray(PAYLOAD_LENGTH.size)
            conn.recv_exact_into(memoryview(length))
            (sent,) = PAYLOAD_LENGTH.unpack(length)
            if sent != len(view):  # before a byte of it is read: nothing applied
                raise StreamOutOfStep(
                    f"push to shard {header.shard_id} of model {header.model!r}: its header announces {len(view)} "
                    f"payload bytes and {sent} followed it; nothing applied (a client of another data plane "
                    "protocol, or a push whose header and payload disagree)",
                    unread=min(sent, len(view) + UNREAD_SLACK),
                )
            conn.recv_exact_into(view)

        response = data_path.receive_push(self.store, header, self.staging, read_payload)
        send_message(conn.sock, ps_pb2.DataResponse(push=response))
        return Outcome.KEEP
