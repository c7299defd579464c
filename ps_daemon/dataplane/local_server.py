"""The daemon's local transport: Pull and Push for clients on its own host, through shared memory.

A rank and its node's daemon share a host, so their bytes need not cross loopback TCP. The
daemon listens on a Unix socket in the Linux abstract namespace (RegisterModelResponse.
local_endpoint; nothing in the filesystem, and only reachable from the same host and network
namespace). The frames are the data plane's DataRequest/DataResponse, and no bytes follow
them: the bytes are in memory both ends map (ps_offload.proto.shared_memory).

* Each connection brings a slot, a memfd passed with its first frame (LocalAttach, window 0).
* A client may attach windows of its own memory, on any of its connections (LocalAttach with a
  memfd): its parameter, gradient and staging buffers. They count against the node's pool
  (server.local_pool_bytes; ps_offload.daemon.dataplane.local_pool) and serve every connection
  of that client until its last one closes.
* A push names where its payload lies and how many bytes were written for it (DataRequest.
  local: a window, or window 0, the slot), which must be what its header announces. The
  client wrote it there before sending the header, so it is whole when the header comes; the
  daemon parses and applies it where it lies (receive_push's `in_place`), with no copy. A
  push applied before is answered without reading it.
* A pull names where its bytes go. The daemon writes them there under the shard's read hold
  (one version); a bf16 or fp16 pull is rounded straight into that place, one pass over the
  bytes. The client reads them once the ShardHeader is back.
* A GRADIENT or APPLY push may name where the shard's new version goes (DataRequest.pull_into,
  in a pull's dtype): the optimizer's pass writes it there as it steps (no second pass reading
  the master back), and the answer says so (PushResponse.pulled); the trainer then has no pull
  to make. A push applied before answers pulled = false, and the trainer pulls as usual.
* A batch (DataBatch) carries pulls and pushes served here in order, each as if it came alone,
  with one answer holding theirs. What a request costs apart from its bytes (a frame each way,
  this thread's wake-up, the token check, the trainer's side of it) is most of what a local
  pull of a MiB costs, both ends' CPU on the trainer's own cores: a trainer sends a block's
  shards, or a step's APPLYs, as one batch. Its requests name places in windows (the slot
  holds one request's bytes). With NVMe, a run of pushes to different shards is served side by
  side so that their commits share groups (ps_offload.daemon.dataplane.batch_runs).

Why reading and writing the client's memory in place is safe: a connection carries one
request at a time, and a client whose request failed midway (its deadline passed, the
connection broke) closes that connection and waits until the daemon has closed it too before
it uses the memory again (ps_offload.trainer.wire.local_client); this thread closes it only
once it is out of the request. A client killed mid-write never sent the header, so nothing of
it is applied. The memory is the client's, and the client is the daemon's own uid: one that
writes its gradient while the daemon reads it trains on what it wrote, as it would with any
buffer it handed to a library.

Who may connect: a peer of the daemon's own uid, or a member of `server.local_group` (a
daemon run as a user of its own, and trainers of their users in that group: SO_PEERCRED;
another is answered PERMISSION_DENIED naming the setting, and the trainer uses the data
plane and says why), at most `server.max_data_connections_per_client` at once (the ranks of one host).
Each connection has a thread (local clients are few), which may wait for a pull's version up
to the request's timeout and `server.max_pull_wait_seconds`. Errors are answered as the data
plane answers them (ps_offload.daemon.rpc.status); with auth.require_token = "all" every
request carries the token.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
import torch

from ps_offload.daemon.config import ServerConfig
from ps_offload.daemon.dataplane.batch_runs import BatchRuns
from ps_offload.daemon.dataplane.local_pool import LocalPool
from ps_offload.daemon.dataplane.local_session import PEERCRED, Refused, Session, close_fds, process_groups, refuse
from ps_offload.daemon.dataplane.requests import DATA_METHODS
from ps_offload.daemon.errors import InvalidArgument, PsError
from ps_offload.daemon.rpc import conversions, data_path
from ps_offload.daemon.rpc.server_security import TokenCheck
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.rpc.status import RateLimitedLog, from_status, status_of
from ps_offload.daemon.store.pull_rounding import PULL_DTYPES
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import FrameError, send_message

log = logging.getLogger(__name__)
quiet_log = RateLimitedLog()  # refusals: a client retrying in a loop must not fill the log


class LocalServer:
    def __init__(
        self,
        *,
        store: ShardStore,
        staging: StagingPool,
        limits: ServerConfig,
        pool: LocalPool,
        token: TokenCheck | None = None,
        observe: Callable[[str, grpc.StatusCode, float], None] | None = None,
        pushes_at_once: int = 1,
    ) -> None:
        """limits: the [server] keys it follows (max_pull_wait_seconds,
        max_data_connections_per_client, data_stall_seconds for the first frame); token: the
        [auth] rule; pool: the node's shared memory (server.local_pool_bytes);
        observe(method, code, seconds): told about every request (metrics); pushes_at_once: how
        many of a batch's pushes are served side by side at most
        (ps_offload.daemon.dataplane.batch_runs; the store says how many of a model's may be)."""
        self.endpoint = f"ps-offload-{uuid.uuid4().hex}"  # per start: a restarted daemon is a new name
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.endpoint)
        self._listener.listen(64)
        self.store = store
        self.staging = staging
        self.pool = pool
        self.max_pull_wait = limits.max_pull_wait_seconds
        self.max_connections = limits.max_data_connections_per_client
        self.group = limits.local_group
        self.group_id = grp.getgrnam(self.group).gr_gid if self.group else None  # (checked at load)
        self.token = token
        self.observe = observe
        self.pushes_at_once = pushes_at_once
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

    @property
    def pool_bytes(self) -> int:
        return self.pool.capacity

    @property
    def pool_bytes_used(self) -> int:
        return self.pool.used

    def processes(self) -> list[tuple[int, int, int]]:
        """(pid, connections, shared bytes) of each client process now."""
        return self.pool.clients()

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
            pid, uid, gid = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
            if not self._admits(pid, uid, gid):
                self.refused += 1
                message = (
                    f"the daemon (uid {os.geteuid()}) shares memory with processes of its own uid"
                    + (f" and of group {self.group!r}" if self.group else "")
                    + f"; uid {uid} is neither (server.local_group names the trainers' group)"
                )
                quiet_log.info("LocalTransport", "PERMISSION_DENIED", f"refused process {pid}: {message}")
                refuse(sock, Refused(grpc.StatusCode.PERMISSION_DENIED, message))
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
                refuse(sock, Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, message))
                continue
            threading.Thread(target=self._connection, args=(sock, pid), name=f"local-{pid}", daemon=True).start()

    def _updates_at_once(self, model: str) -> int:
        return self.store.updates_at_once(model, self.pushes_at_once)

    def _admits(self, pid: int, uid: int, gid: int) -> bool:
        """The daemon's own uid, or a process in server.local_group: its group or one of its
        supplementary groups, as the kernel holds them for it now (/proc/PID/status)."""
        if uid == os.geteuid():
            return True
        if self.group_id is None:
            return False
        return gid == self.group_id or self.group_id in process_groups(pid)

    def _connection(self, sock: socket.socket, pid: int) -> None:
        session, joined = Session(sock, pid, BatchRuns(self.pushes_at_once, self._updates_at_once)), False
        try:
            sock.settimeout(self.stall_seconds)  # a client that never sends its slot goes
            request, fds = session.receive()
            session.open(request, fds)
            joined = self.pool.join(session.client, pid)
            if not joined:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "another process uses this client id")
            send_message(sock, ps_pb2.DataResponse())
            sock.settimeout(None)  # then it may idle between steps as long as it likes
            while not self.stopping:
                request, fds = session.receive()
                pushing = _pushes(request)
                with self._cond:
                    self._pushing += pushing
                try:
                    keep = self._serve(session, request, fds)
                finally:
                    with self._cond:
                        self._pushing -= pushing
                        self._cond.notify_all()
                if not keep:
                    return
        except Refused as exc:
            quiet_log.info("LocalTransport", exc.code.name, f"refused process {pid}: {exc}")
            refuse(sock, exc)
        except (FrameError, OSError) as exc:
            if not self.stopping:
                log.debug("local transport: process %d hung up: %s", pid, exc)
        finally:
            with self._cond:
                self._connections.discard(sock)
            session.batch_runs.close()  # none of its pushes still reads the client's memory
            sock.close()  # out of every request: the client may use its memory again
            if session.slot is not None:
                session.slot.close()
            if joined:
                self.pool.leave(session.client)

    def _serve(self, session: Session, request: ps_pb2.DataRequest, fds: list[int]) -> bool:
        """Answers one request (a batch: each of its requests, in one answer); False when the
        connection cannot be trusted any more."""
        kind, sock = request.WhichOneof("kind"), session.sock
        if kind == "attach" or fds:
            try:
                if kind != "attach":
                    close_fds(fds)
                    raise InvalidArgument(f"a {kind or 'DataRequest'} frame carries no descriptors; {len(fds)} came")
                self._attach(session, request.attach, fds)
                send_message(sock, ps_pb2.DataResponse())
            except PsError as exc:
                send_message(sock, ps_pb2.DataResponse(code=status_of(exc).value[0], message=str(exc)))
            return True
        seconds = request.timeout_ms / 1000 if request.timeout_ms else self.max_pull_wait
        if kind != "batch":
            answer, keep = self._answer(session, request, request.authorization, min(seconds, self.max_pull_wait))
            send_message(sock, answer)
            return keep
        deadline = time.monotonic() + seconds

        def answer(inner: ps_pb2.DataRequest) -> tuple[ps_pb2.DataResponse, bool]:
            left = max(0.0, min(deadline - time.monotonic(), self.max_pull_wait))
            return self._answer(session, inner, request.authorization, left)

        # Each as if it came alone; a run of pushes side by side (ps_offload.daemon.dataplane.batch_runs).
        answers, keep = session.batch_runs.serve(request.batch.requests, answer)
        send_message(sock, ps_pb2.DataResponse(answers=answers))
        return keep

    def _answer(
        self, session: Session, request: ps_pb2.DataRequest, authorization: str, pull_wait: float
    ) -> tuple[ps_pb2.DataResponse, bool]:
        """A pull's or a push's answer (a status it failed with, in it), and whether the
        connection may go on; `pull_wait`: how long a pull may wait for its version."""
        kind, code, started = request.WhichOneof("kind"), grpc.StatusCode.OK, time.perf_counter()
        try:
            if kind in DATA_METHODS and self.token is not None:
                refusal = self.token.refusal(DATA_METHODS[kind], authorization or None)
                if refusal is not None:
                    raise from_status(*refusal)
            if kind == "pull":
                return ps_pb2.DataResponse(shard=self._pull(session, request, pull_wait)), True
            if kind == "push":
                return ps_pb2.DataResponse(push=self._push(session, request)), True
            raise InvalidArgument("a DataRequest must carry a pull, a push, a batch of them, or an attach")
        except PsError as exc:
            code = status_of(exc)
            return ps_pb2.DataResponse(code=code.value[0], message=str(exc)), True
        except Exception as exc:  # noqa: BLE001 - answered, logged, connection closed
            code = grpc.StatusCode.INTERNAL
            log.exception("local transport request failed")
            message = f"internal error: {type(exc).__name__}: {exc}"
            return ps_pb2.DataResponse(code=code.value[0], message=message), False
        finally:
            if self.observe is not None and kind in DATA_METHODS:
                self.observe(f"Local/{kind.capitalize()}", code, time.perf_counter() - started)

    def _attach(self, session: Session, attach: ps_pb2.LocalAttach, fds: list[int]) -> None:
        if len(fds) != 1 or attach.client not in ("", session.client):
            close_fds(fds)
            raise InvalidArgument(
                f"an attach carries exactly one memfd ({len(fds)} came) and names this connection's client"
            )
        size = self.pool.attach(session.client, attach.window, fds[0])
        log.debug("local transport: process %d attached window %d (%d bytes)", session.pid, attach.window, size)

    def _place(self, session: Session, request: ps_pb2.DataRequest, nbytes: int, what: str) -> torch.Tensor:
        """Where a request's bytes lie or go (DataRequest.local): `nbytes` of them, checked."""
        ref = request.local
        if ref.window:
            return self.pool.view(session.client, ref.window, ref.offset, nbytes, what)
        if ref.offset + nbytes > session.slot.size:
            raise InvalidArgument(
                f"{what}: {nbytes} bytes at offset {ref.offset} do not fit the local slot of {session.slot.size} "
                "bytes: the client's slot is too small for this shard"
            )
        return session.slot.bytes[ref.offset : ref.offset + nbytes]

    def _pull(self, session: Session, request: ps_pb2.DataRequest, timeout: float) -> ps_pb2.ShardHeader:
        pull = conversions.pull_request(request.pull)
        room = request.local.nbytes if request.local.window else session.slot.size - request.local.offset
        target = self._place(session, request, room, f"pull of shard {pull.shard_id}")
        into = RoundInto(target, self.staging)
        with data_path.serve_pull(self.store, pull, timeout=timeout, scratch=into) as (header, raw):
            if len(raw) > len(target):
                raise InvalidArgument(
                    f"pull of shard {pull.shard_id}: its {len(raw)} bytes do not fit the {len(target)} bytes the "
                    "request gave (the local slot, or its LocalRef's nbytes)"
                )
            if len(raw) and not into.holds(raw):  # rounded there already: nothing to copy
                target[: len(raw)].copy_(torch.frombuffer(raw, dtype=torch.uint8))  # under the read hold
        return header

    def _push(self, session: Session, request: ps_pb2.DataRequest) -> ps_pb2.PushResponse:
        header = request.push
        what = f"push to shard {header.shard_id}"
        if not request.HasField("local"):
            raise InvalidArgument(
                f"{what}: names no place (DataRequest.local) for its payload; a trainer of an older release? Upgrade "
                "the trainers with the daemons"
            )
        if request.local.nbytes != header.nbytes:
            raise InvalidArgument(
                f"{what}: {request.local.nbytes} bytes were written for it, its header says {header.nbytes}; "
                "nothing applied"
            )
        place = self._place(session, request, header.nbytes, what)  # before the store: nothing read yet
        padded = -(-header.nbytes // 4) * 4
        try:  # parsed where it lies: as fp32 elements (ps_offload.daemon.model.encodings.parse)
            words = self._place(session, request, padded, what) if padded != header.nbytes else place
        except InvalidArgument:
            words = None  # the window ends inside the last word: through a staging buffer

        def in_place(nbytes: int) -> torch.Tensor | None:
            if words is None or words.data_ptr() % 4:
                return None
            return words.view(torch.float32)

        def read_into(view: memoryview) -> None:
            if len(view):
                torch.frombuffer(view, dtype=torch.uint8).copy_(place)

        def pull_into(numel: int) -> torch.Tensor:  # asked for once the push is checked against its shard
            target = self._pull_target(session, request, numel)
            if _overlap(target, place):
                raise InvalidArgument(f"{what}: its pull_into overlaps its payload; name another place")
            return target

        return data_path.receive_push(
            self.store, header, self.staging, read_into, in_place=in_place,
            pull_into=pull_into if request.HasField("pull_into") else None,
        )  # fmt: skip

    def _pull_target(self, session: Session, request: ps_pb2.DataRequest, numel: int) -> torch.Tensor:
        """Where a push asks its shard's new version to go (DataRequest.pull_into), checked
        before anything is read: a place in an attached window, exactly the shard's numel in a
        pull's dtype, aligned for it."""
        header, ref = request.push, request.pull_into
        what = f"push to shard {header.shard_id}: its pull_into"
        if header.kind not in (ps_pb2.GRADIENT, ps_pb2.APPLY):
            raise InvalidArgument(f"{what} is for GRADIENT and APPLY pushes, not {ps_pb2.PushKind.Name(header.kind)}")
        dtype = conversions.DTYPE_NAMES.get(request.pull_dtype)
        if dtype is None:
            raise InvalidArgument(f"{what} names no pull dtype (pull_dtype FLOAT32, BFLOAT16 or FLOAT16)")
        torch_dtype = PULL_DTYPES[dtype]
        if not ref.window or ref.nbytes != numel * torch_dtype.itemsize or ref.offset % torch_dtype.itemsize:
            raise InvalidArgument(
                f"{what} must be {numel * torch_dtype.itemsize} bytes ({numel} {dtype}) at an offset aligned for "
                f"{dtype} in an attached window; it names {ref.nbytes} bytes at offset {ref.offset} of window "
                f"{ref.window}"
            )
        return self.pool.view(session.client, ref.window, ref.offset, ref.nbytes, what).view(torch_dtype)


class RoundInto:
    """A pull's scratch (ShardStore.pull's `scratch`) that hands out the pull's own target
    once, where it is word-aligned and large enough, so a narrow pull is rounded straight
    into it; any other request borrows from the staging pool."""

    def __init__(self, target: torch.Tensor, staging: StagingPool) -> None:
        self.target = target
        self.staging = staging
        self.given = False

    @contextlib.contextmanager
    def __call__(self, numel: int) -> Iterator[torch.Tensor]:
        if self.given or self.target.data_ptr() % 4 or numel * 4 > len(self.target):
            with self.staging.borrow(numel) as buffer:
                yield buffer
            return
        self.given = True
        yield self.target[: numel * 4].view(torch.float32)

    def holds(self, raw: memoryview) -> bool:
        """Whether `raw` is the target's own first bytes (rounded into it)."""
        return self.given and torch.frombuffer(raw, dtype=torch.uint8).data_ptr() == self.target.data_ptr()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b.numel() * b.element_size() and b_start < a_start + a.numel() * a.element_size()


def _pushes(request: ps_pb2.DataRequest) -> bool:
    """Whether `request` is a push or a batch with one (stop lets them finish)."""
    kind = request.WhichOneof("kind")
    return kind == "push" or (kind == "batch" and any(r.WhichOneof("kind") == "push" for r in request.batch.requests))
