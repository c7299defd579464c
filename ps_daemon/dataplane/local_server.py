"""The daemon's local transport: Pull and Push for clients on its own host, through shared memory.

A rank and its node's daemon share a host, so their bytes need not cross loopback TCP. The
daemon listens on a Unix socket in the Linux abstract namespace (RegisterModelResponse.
local_endpoint; nothing in the filesystem, and only reachable from the same host and network
namespace). Each client connection brings its own slot: a memfd passed with its first frame
(SCM_RIGHTS), sealed against shrinking, mapped here. After that the frames are the data
plane's DataRequest/DataResponse, and no bytes follow them:

* a push: the client wrote the payload into the slot, then sent the header. receive_push
  (ps_offload.daemon.rpc.data_path) copies it into a staging buffer before anything is parsed
  or applied, so a client killed mid-write, or writing the slot later, changes nothing; a
  push applied before is answered without reading the slot.
* a pull: the daemon copies the bytes into the slot under the shard's read hold (one
  version), then answers the ShardHeader; the client copies them out.

Who may connect: a peer of the daemon's own uid (SO_PEERCRED; another uid is logged and
closed), at most `server.max_data_connections_per_client` at once (the ranks of one host).
Each connection has a thread (local clients are few), which may wait for a pull's version up
to the request's timeout and `server.max_pull_wait_seconds`. Errors are answered as the data
plane answers them (ps_offload.daemon.rpc.status); with auth.require_token = "all" every
request carries the token.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable

import grpc
import torch

from ps_offload.daemon.config import ServerConfig
from ps_offload.daemon.dataplane.requests import DATA_METHODS
from ps_offload.daemon.errors import InvalidArgument, PsError
from ps_offload.daemon.rpc import conversions, data_path
from ps_offload.daemon.rpc.server_security import TokenCheck
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.rpc.status import RateLimitedLog, from_status, status_of
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import FrameError, recv_message, send_message, split_frame

log = logging.getLogger(__name__)
quiet_log = RateLimitedLog()  # refusals: a client retrying in a loop must not fill the log

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Refused(Exception):
    """The connection may not stay: answered with `code` and the message, then closed."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Slot:
    """A client's shared memory, mapped here. Closing unmaps it (the fd is closed at once:
    the mapping holds the memory)."""

    def __init__(self, fd: int) -> None:
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size <= 0:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the local slot must be a memfd of at least one byte")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            # Shrunk under a mapping, reading it would kill the daemon (SIGBUS): refuse it unsealed.
            if not seals & fcntl.F_SEAL_SHRINK:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "the local slot must be a memfd sealed with F_SEAL_SHRINK (MFD_ALLOW_SEALING)",
                )
            self.size = info.st_size
            self._map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # (size,) uint8, over the mapping

    def read_into(self, view: memoryview) -> None:
        if len(view) > self.size:
            raise InvalidArgument(f"a push of {len(view)} bytes does not fit the local slot of {self.size} bytes")
        if len(view):
            torch.frombuffer(view, dtype=torch.uint8).copy_(self.bytes[: len(view)])

    def write(self, raw: memoryview) -> None:
        if len(raw) > self.size:
            raise InvalidArgument(f"a pull of {len(raw)} bytes does not fit the local slot of {self.size} bytes")
        if len(raw):
            self.bytes[: len(raw)].copy_(torch.frombuffer(raw, dtype=torch.uint8))

    def close(self) -> None:
        del self.bytes  # the tensor exports the mapping: it must go before munmap
        self._map.close()


class LocalServer:
    def __init__(
        self,
        *,
        store: ShardStore,
        staging: StagingPool,
        limits: ServerConfig,
        token: TokenCheck | None = None,
        observe: Callable[[str, grpc.StatusCode, float], None] | None = None,
    ) -> None:
        """limits: the [server] keys it follows (max_pull_wait_seconds,
        max_data_connections_per_client, data_stall_seconds for the first frame); token: the
        [auth] rule; observe(method, code, seconds): told about every request (metrics)."""
        self.endpoint = f"ps-offload-{uuid.uuid4().hex}"  # per start: a restarted daemon is a new name
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.endpoint)
        self._listener.listen(64)
        self.store = store
        self.staging = staging
        self.max_pull_wait = limits.max_pull_wait_seconds
        self.max_connections = limits.max_data_connections_per_client
        self.token = token
        self.observe = observe
        self.refused = 0  # connections refused since the start
        self.stopping = False
        self._connections: set[socket.socket] = set()
        self._pushing = 0  # pushes being served: stop waits for them
        self.stall_seconds = limits.data_stall_seconds
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @classmethod
    def bind(cls, **options) -> LocalServer | None:
        """A LocalServer (not yet serving), or None where abstract Unix sockets cannot be had
        (same-host clients then use the data plane)."""
        try:
            return cls(**options)
        except OSError as exc:
            log.warning("no local transport: %s", exc)
            return None

    @property
    def connections(self) -> int:
        return len(self._connections)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name="local-transport", daemon=True)
        self._thread.start()

    def stop(self, grace: float) -> None:
        """Stops accepting, lets pushes in progress finish for up to `grace` seconds (a pull
        waiting for a version is not waited for), then closes every connection (their threads
        unmap their slots)."""
        with self._cond:
            self.stopping = True
        try:  # wakes the accept
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                wake.connect("\0" + self.endpoint)
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(10)
        self._listener.close()
        with self._cond:
            self._cond.wait_for(lambda: self._pushing == 0, timeout=grace)
            for sock in self._connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, which closes it
                except OSError:
                    pass

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self.stopping:
                    return
                log.warning("local transport: accept failed: %s", exc)
                time.sleep(0.1)  # out of descriptors: the pending connection stays queued
                continue
            if self.stopping:
                sock.close()
                return
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            if uid != os.geteuid():
                self.refused += 1
                quiet_log.info(
                    "LocalTransport", "PERMISSION_DENIED", f"refused process {pid} of uid {uid}: not the daemon's uid"
                )
                sock.close()
                continue
            with self._cond:
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections.add(sock)
            if full:
                self.refused += 1
                message = (
                    f"{self.max_connections} local connections are open "
                    "(server.max_data_connections_per_client); use the data plane"
                )
                quiet_log.info("LocalTransport", "RESOURCE_EXHAUSTED", f"refused process {pid}: {message}")
                _refuse(sock, Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, message))
                continue
            threading.Thread(target=self._connection, args=(sock, pid), name=f"local-{pid}", daemon=True).start()

    def _connection(self, sock: socket.socket, pid: int) -> None:
        slot = None
        try:
            sock.settimeout(self.stall_seconds)  # a client that never sends its slot goes
            slot = _handshake(sock)
            sock.settimeout(None)  # then it may idle between steps as long as it likes
            while not self.stopping:
                request = recv_message(sock, ps_pb2.DataRequest)
                pushing = request.WhichOneof("kind") == "push"
                with self._cond:
                    self._pushing += pushing
                try:
                    keep = self._serve(sock, slot, request)
                finally:
                    with self._cond:
                        self._pushing -= pushing
                        self._cond.notify_all()
                if not keep:
                    return
        except Refused as exc:
            quiet_log.info("LocalTransport", exc.code.name, f"refused process {pid}: {exc}")
            _refuse(sock, exc)
        except (FrameError, OSError) as exc:
            if not self.stopping:
                log.debug("local transport: process %d hung up: %s", pid, exc)
        finally:
            with self._cond:
                self._connections.discard(sock)
            sock.close()
            if slot is not None:
                slot.close()

    def _serve(self, sock: socket.socket, slot: Slot, request: ps_pb2.DataRequest) -> bool:
        """Answers one request; False when the connection cannot be trusted any more."""
        kind, code, started = request.WhichOneof("kind"), grpc.StatusCode.OK, time.perf_counter()
        try:
            if kind in DATA_METHODS and self.token is not None:
                refusal = self.token.refusal(DATA_METHODS[kind], request.authorization or None)
                if refusal is not None:
                    raise from_status(*refusal)
            if kind == "pull":
                send_message(sock, ps_pb2.DataResponse(shard=self._pull(slot, request)))
            elif kind == "push":
                send_message(sock, ps_pb2.DataResponse(push=self._push(slot, request.push)))
            else:
                raise InvalidArgument("a DataRequest must carry a pull or a push")
            return True
        except PsError as exc:
            code = status_of(exc)
            send_message(sock, ps_pb2.DataResponse(code=code.value[0], message=str(exc)))
            return True
        except Exception as exc:  # noqa: BLE001 - answered, logged, connection closed
            code = grpc.StatusCode.INTERNAL
            log.exception("local transport request failed")
            message = f"internal error: {type(exc).__name__}: {exc}"
            send_message(sock, ps_pb2.DataResponse(code=code.value[0], message=message))
            return False
        finally:
            if self.observe is not None and kind in DATA_METHODS:
                self.observe(f"Local/{kind.capitalize()}", code, time.perf_counter() - started)

    def _pull(self, slot: Slot, request: ps_pb2.DataRequest) -> ps_pb2.ShardHeader:
        pull = conversions.pull_request(request.pull)
        timeout = min(request.timeout_ms / 1000, self.max_pull_wait) if request.timeout_ms else self.max_pull_wait
        with data_path.serve_pull(self.store, pull, timeout=timeout, staging=self.staging) as (header, raw):
            slot.write(raw)  # under the read hold: one version
        return header

    def _push(self, slot: Slot, header: ps_pb2.PushHeader) -> ps_pb2.PushResponse:
        if header.nbytes > slot.size:  # before the store: nothing of it can be read
            raise InvalidArgument(
                f"a push of {header.nbytes} bytes does not fit the local slot of {slot.size} bytes: "
                "the client's slot is too small for this shard"
            )
        return data_path.receive_push(self.store, header, self.staging, slot.read_into)


def _handshake(sock: socket.socket) -> Slot:
    """The client's first frame (an empty DataRequest) with its slot's fd; answered with an
    empty DataResponse once the slot is mapped."""
    inbox, fds = bytearray(), []
    while (body := split_frame(inbox)) is None:
        data, got, _, _ = socket.recv_fds(sock, 4096, 4)
        if not data:
            raise FrameError("hung up before its first frame")
        inbox += data
        fds += got
    try:
        ps_pb2.DataRequest.FromString(body)
    except Exception:  # noqa: BLE001 - any decoding failure is the same refusal
        _close_fds(fds)
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the first frame must be an empty DataRequest") from None
    if len(fds) != 1 or inbox:
        _close_fds(fds)
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the first frame on the local endpoint must carry exactly one fd, the client's memfd slot "
            f"(SCM_RIGHTS), and nothing after it; it carried {len(fds)}",
        )
    slot = Slot(fds[0])
    send_message(sock, ps_pb2.DataResponse())
    return slot


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _refuse(sock: socket.socket, refusal: Refused) -> None:
    try:
        sock.settimeout(1.0)
        send_message(sock, ps_pb2.DataResponse(code=refusal.code.value[0], message=str(refusal)))
    except OSError:
        pass
    finally:
        sock.close()
