"""The trainer's end of its own node's daemon through shared memory (the daemon's side, and why:
ps_daemon/dataplane/local_server.py).

Each connection to the daemon's abstract Unix socket (RegisterModelResponse.local_endpoint)
owns a slot: a memfd, sealed so that neither end can shrink it under the other's mapping,
passed with the first frame. A push copies its payload into the slot, then sends the header;
a pull sends its request and copies the bytes out of the slot once the ShardHeader is back.
Only headers cross the socket. A connection serves one request at a time, so its slot is
never shared between two.

Failures raise DataPlaneError (a grpc.RpcError), so ShardedClient retries them as it retries
the data plane; an endpoint it cannot reach (another host or network namespace, another uid)
is UNAVAILABLE. A connection that failed mid-request is closed, never reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import queue
import socket
from collections.abc import Iterator

import grpc
import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import FrameError, frame, recv_message, send_message
from ps_offload.proto.payloads import topk_nbytes
from ps_offload.proto.pull import PullStreamError, check_pull_header
from ps_offload.proto.push import Push
from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.wire.dataplane_client import STATUS_CODES, DataPlaneError, pull_request

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def slot_bytes_for(max_numel: int) -> int:
    """A slot that holds any push or pull of a shard of `max_numel` elements: the largest
    payload is a TOPK one keeping every element (an index and a value each). Pages never
    touched cost nothing."""
    return topk_nbytes(max_numel)


class _Connection:
    """One socket to the daemon and its slot, mapped here too."""

    def __init__(self, endpoint: str, slot_bytes: int, timeout: float) -> None:
        fd = os.memfd_create("ps-offload-slot", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, slot_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(fd, slot_bytes)
            self.slot = torch.frombuffer(self._map, dtype=torch.uint8)  # (slot_bytes,) over the mapping
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.settimeout(timeout)
                self.sock.connect("\0" + endpoint)
                socket.send_fds(self.sock, [frame(ps_pb2.DataRequest())], [fd])
                _answer(self.sock)  # refused (another uid): FrameError, the daemon hung up
            except BaseException:
                self.close()
                raise
        finally:
            os.close(fd)  # the daemon has its own; the mapping keeps ours

    def write(self, data: memoryview) -> None:
        """`data` into the slot; torch's copy (threads for large ones) unless it is read-only,
        which torch will not wrap."""
        if data.readonly:
            self._map[: len(data)] = data
        elif len(data):
            self.slot[: len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))

    def close(self) -> None:
        self.sock.close()
        del self.slot  # exports the mapping: it must go before munmap
        self._map.close()


class LocalClient:
    """Up to `max_connections` pooled connections to one daemon's local endpoint, each with a
    slot of `slot_bytes`."""

    def __init__(
        self,
        endpoint: str,
        *,
        slot_bytes: int,
        max_connections: int,
        security: ClientSecurity | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self.endpoint = endpoint
        self.slot_bytes = slot_bytes
        self._max = max_connections
        self._idle: queue.LifoQueue[_Connection] = queue.LifoQueue()
        token = (security or ClientSecurity()).token()
        self._authorization = f"Bearer {token}" if token else ""
        # Proven here, not assumed: a daemon on another host or namespace, or of another uid,
        # fails this connect, and the caller uses the data plane instead.
        self._idle.put(self._connect(connect_timeout))

    def _connect(self, timeout: float) -> _Connection:
        try:
            return _Connection(self.endpoint, self.slot_bytes, timeout)
        except (FrameError, OSError) as exc:
            raise DataPlaneError(
                grpc.StatusCode.UNAVAILABLE, f"cannot use the local endpoint {self.endpoint}: {exc}"
            ) from None
        except DataPlaneError as exc:
            raise DataPlaneError(exc.code(), f"local endpoint {self.endpoint}: {exc.details()}") from None

    @contextlib.contextmanager
    def _connection(self, timeout: float) -> Iterator[_Connection]:
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            conn = self._connect(timeout)
        conn.sock.settimeout(timeout)
        try:
            yield conn
        except DataPlaneError:  # a complete answer: the stream is still in step
            self._release(conn)
            raise
        except (FrameError, OSError) as exc:
            conn.close()
            expired = isinstance(exc, TimeoutError) and exc.errno is None
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.UNAVAILABLE
            raise DataPlaneError(code, f"local endpoint {self.endpoint}: {exc}") from None
        except BaseException:
            conn.close()
            raise
        self._release(conn)

    def _release(self, conn: _Connection) -> None:
        if self._idle.qsize() < self._max:
            self._idle.put(conn)
        else:
            conn.close()

    def pull_into(
        self,
        model: str,
        shard_id: int,
        *,
        min_version: int,
        out: memoryview,
        timeout: float,
        tensor: int = ps_pb2.MASTER,
        dtype: int = ps_pb2.FLOAT32,
    ) -> int:
        pull = ps_pb2.PullRequest(model=model, shard_id=shard_id, min_version=min_version, tensor=tensor, dtype=dtype)
        request = pull_request(pull, timeout, self._authorization)
        view = memoryview(out).cast("B")
        with self._connection(timeout + 5.0) as conn:
            send_message(conn.sock, request)
            header = _answer(conn.sock).shard
            try:
                check_pull_header(header, len(view), dtype, f"shard {shard_id}")
            except PullStreamError as exc:
                raise FrameError(str(exc)) from None  # the plan is wrong: close the connection
            if len(view):
                torch.frombuffer(view, dtype=torch.uint8).copy_(conn.slot[: len(view)])
            return header.version

    def push(self, push: Push, *, timeout: float) -> ps_pb2.PushResponse:
        """Writes the payload into the slot, then sends the header: the daemon reads the slot
        only once the header has come, and not at all for a (shard, step) it applied before."""
        data = memoryview(push.data).cast("B")
        if len(data) > self.slot_bytes:
            raise DataPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a push of {len(data)} bytes does not fit the local slot of {self.slot_bytes} bytes",
            )
        with self._connection(timeout) as conn:
            conn.write(data)
            send_message(conn.sock, ps_pb2.DataRequest(push=push.header, authorization=self._authorization))
            return _answer(conn.sock).push

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().close()


def _answer(sock: socket.socket) -> ps_pb2.DataResponse:
    """The daemon's answer; a status it answered with raises DataPlaneError (the connection stays usable)."""
    response = recv_message(sock, ps_pb2.DataResponse)
    if response.code:
        raise DataPlaneError(STATUS_CODES.get(response.code, grpc.StatusCode.UNKNOWN), response.message)
    return response
