"""The trainer's end of its own node's daemon through shared memory (the daemon's side, and why:
ps_daemon/dataplane/local_server.py).

Each connection to the daemon's abstract Unix socket (RegisterModelResponse.local_endpoint)
owns a slot: a memfd, sealed so that neither end can shrink it under the other's mapping,
passed with the first frame. The process's windows (ps_offload.trainer.wire.host_windows:
its parameter, gradient and staging buffers) are attached once per daemon, on any
connection. Only headers cross the socket:

* a push from a window names where its payload lies, and the daemon reads it there; any
  other push is copied into the slot first;
* a pull into a window names where its bytes go, and the daemon writes them there; any other
  pull is written into the slot and copied out.

A connection serves one request at a time. One that failed midway (a deadline, a broken
socket) is closed, and when the request named a window this client waits until the daemon
has closed its end as well, which it does only once it is out of the request: until then
it may still read or write that memory, which the trainer must not reuse (a late pull
landing in a buffer already given to another shard would be silent corruption). A daemon
that does not let go within FENCE_SECONDS makes this client refuse every later request
(LocalFenceError: the trainer stops, loudly).

Failures raise DataPlaneError (a grpc.RpcError), so ShardedClient retries them as it retries
the data plane; an endpoint it cannot reach (another host or network namespace, another uid)
is UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import FrameError, frame, recv_message, send_message
from ps_offload.proto.payloads import topk_nbytes
from ps_offload.proto.pull import Pull, PullStreamError, check_pull_header
from ps_offload.proto.push import Push
from ps_offload.proto.security import ClientSecurity
from ps_offload.proto.shared_memory import SharedMapping, sealed_memfd
from ps_offload.trainer.wire.dataplane_client import STATUS_CODES, DataPlaneError, pull_request
from ps_offload.trainer.wire.host_windows import HostWindow, HostWindows
from ps_offload.trainer.wire.slot_region import WindowPlace
from ps_offload.trainer.wire.transport import PullInto

log = logging.getLogger(__name__)

FENCE_SECONDS = 60.0
"""How long a failed request on shared memory may keep the daemon busy before this client
gives up on the daemon (LocalFenceError)."""


class LocalFenceError(RuntimeError):
    """The daemon did not finish a failed request on memory this process shares with it: that
    memory may still change under the trainer, so nothing more is sent."""


def slot_bytes_for(max_numel: int) -> int:
    """A slot that holds any push or pull of a shard of `max_numel` elements: the largest
    payload is a TOPK one keeping every element (an index and a value each). Pages never
    touched cost nothing."""
    return topk_nbytes(max_numel)


class _Connection:
    """One socket to the daemon and its slot, mapped here too."""

    def __init__(self, endpoint: str, client: str, slot_bytes: int, timeout: float) -> None:
        fd = sealed_memfd(slot_bytes, "ps-offload-slot")
        try:
            self.slot = SharedMapping(fd)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.settimeout(timeout)
                self.sock.connect("\0" + endpoint)
                attach = ps_pb2.LocalAttach(client=client, window=0)
                try:
                    socket.send_fds(self.sock, [frame(ps_pb2.DataRequest(attach=attach))], [fd])
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused at once: its answer is still there to read
                _answer(self.sock)  # refused: DataPlaneError, with the daemon's reason
            except BaseException:
                self.close()
                raise
        finally:
            os.close(fd)  # the daemon has its own; the mapping keeps ours

    def fence(self, seconds: float) -> bool:
        """After a failed request: whether the daemon closed its end (so it is out of that
        request) within `seconds`. Closes the connection either way."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if not self.sock.recv(1 << 16):
                    return True
            return False
        except TimeoutError:
            return False
        except OSError:  # reset: the daemon's end is gone
            return True
        finally:
            self.close()

    def close(self) -> None:
        self.sock.close()
        self.slot.close()


class LocalClient:
    """Up to `max_connections` pooled connections to one daemon's local endpoint, each with a
    slot of `slot_bytes`, and the process's `windows` attached to that daemon."""

    def __init__(
        self,
        endpoint: str,
        *,
        slot_bytes: int,
        max_connections: int,
        security: ClientSecurity | None = None,
        connect_timeout: float = 10.0,
        windows: HostWindows | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.slot_bytes = slot_bytes
        self.client_id = uuid.uuid4().hex  # the daemon keys this process's windows by it
        self._max = max_connections
        self._idle: queue.LifoQueue[_Connection] = queue.LifoQueue()
        token = (security or ClientSecurity()).token()
        self._authorization = f"Bearer {token}" if token else ""
        self._lock = threading.Lock()
        self._open = 0  # connections open: at 0 the daemon has let go of the windows
        self._attached: set[int] = set()  # windows this daemon holds
        self._fenced: str | None = None
        # Bytes moved where they lie in a window, and through the slot (one more copy here).
        self.bytes_in_place = 0
        self.bytes_copied = 0
        self.pulls_carried = 0  # pushes whose answer said the new version was written where asked (pull_into)
        self.connections_opened = 0  # over its life: a pool too small for its callers opens them again and again
        self.round_trips = 0  # pulls, pushes and batches sent: a batch of a block's shards is one
        # Whether the daemon takes batches (DataBatch: protocol 3), from its registration answer:
        # ShardedClient sends an older one's requests one by one.
        self.takes_batches = False
        self._windows = windows or HostWindows()
        # Proven here, not assumed: a daemon on another host or namespace, or of another uid,
        # fails this connect, and the caller uses the data plane instead.
        self._idle.put(self._connect(connect_timeout))
        self._windows.add_attacher(self.attach)

    def _connect(self, timeout: float) -> _Connection:
        try:
            conn = _Connection(self.endpoint, self.client_id, self.slot_bytes, timeout)
        except (FrameError, OSError) as exc:
            raise DataPlaneError(
                grpc.StatusCode.UNAVAILABLE, f"cannot use the local endpoint {self.endpoint}: {exc}"
            ) from None
        except DataPlaneError as exc:
            raise DataPlaneError(exc.code(), f"local endpoint {self.endpoint}: {exc.details()}") from None
        with self._lock:
            self._open += 1
            self.connections_opened += 1
            first = self._open == 1  # the first, or the daemon let go of the windows with the last
            if first:
                self._attached.clear()
        if first:
            try:
                for window in self._windows.windows:
                    self._attach_on(conn, window)
            except (FrameError, OSError) as exc:
                self._closed(conn)
                raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"local endpoint {self.endpoint}: {exc}") from None
        return conn

    @property
    def connections_in_use(self) -> int:
        """Connections lent to calls now (open less idle)."""
        with self._lock:
            return self._open - self._idle.qsize()

    def _closed(self, conn: _Connection) -> None:
        conn.close()
        with self._lock:
            self._open -= 1

    def attach(self, window: HostWindow) -> bool:
        """Attaches `window` to this daemon; whether it took it (its pool may be full)."""
        try:
            with self._connection(10.0, fence=False) as conn:
                return self._attach_on(conn, window)
        except DataPlaneError as exc:
            log.warning("local endpoint %s: window %d not attached: %s", self.endpoint, window.number, exc.details())
            return False

    def _attach_on(self, conn: _Connection, window: HostWindow) -> bool:
        attach = ps_pb2.LocalAttach(client=self.client_id, window=window.number)
        socket.send_fds(conn.sock, [frame(ps_pb2.DataRequest(attach=attach))], [window.fd])
        try:
            _answer(conn.sock)
        except DataPlaneError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or "attached already" not in exc.details():
                log.warning(
                    "the node's daemon did not take %d bytes of shared memory (%s): this process's bytes to it "
                    "go through a copy",
                    window.nbytes,
                    exc.details(),
                )
                return False
        with self._lock:
            self._attached.add(window.number)
        return True

    @contextlib.contextmanager
    def _connection(self, timeout: float, *, fence: bool) -> Iterator[_Connection]:
        if self._fenced is not None:
            raise LocalFenceError(self._fenced)
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
            if fence and not conn.fence(FENCE_SECONDS):
                self._fenced = (
                    f"the node's daemon (local endpoint {self.endpoint}) did not finish a failed request on memory "
                    f"this process shares with it within {FENCE_SECONDS:g} s: that memory may still change, so the "
                    "trainer cannot go on; restart it (the daemons keep every committed step)"
                )
            self._closed(conn)
            expired = isinstance(exc, TimeoutError) and exc.errno is None
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.UNAVAILABLE
            raise DataPlaneError(code, f"local endpoint {self.endpoint}: {exc}") from None
        except BaseException:
            self._closed(conn)
            raise
        self._release(conn)

    def _release(self, conn: _Connection) -> None:
        if self._idle.qsize() < self._max:
            self._idle.put(conn)
        else:
            self._closed(conn)

    def _ref(self, view: memoryview) -> WindowPlace | None:
        ref = self._windows.find(view)
        return ref if ref is not None and ref.window in self._attached else None

    def pull_into(self, pull: Pull, *, out: memoryview, timeout: float) -> int:
        request = pull_request(pull.request, timeout, self._authorization)
        shard_id, dtype = pull.shard_id, pull.dtype
        view = memoryview(out).cast("B")
        ref = self._ref(view)
        if ref is not None:
            ref.into(request.local)  # written there by the daemon
        with self._connection(timeout + 5.0, fence=ref is not None) as conn:
            self._sent()
            send_message(conn.sock, request)
            header = _answer(conn.sock).shard
            try:
                check_pull_header(header, len(view), dtype, f"shard {shard_id}")
            except PullStreamError as exc:
                raise FrameError(str(exc)) from None  # the plan is wrong: close the connection
            if ref is None and len(view):
                torch.frombuffer(view, dtype=torch.uint8).copy_(conn.slot.bytes[: len(view)])
            self._count(ref, len(view))
            return header.version

    def push(self, push: Push, *, timeout: float, pull_into: PullInto | None = None) -> ps_pb2.PushResponse:
        """A payload in a window is read there by the daemon; any other is written into the
        slot first. Either way the header follows it: the daemon reads the payload only once
        the header has come, and not at all for a (shard, step) it applied before.
        `pull_into` in a window this daemon has: the daemon writes the new version there in
        the step's own pass (the answer's `pulled`); elsewhere it is not asked."""
        data = memoryview(push.data).cast("B")
        ref = self._ref(data)
        target = self._ref(memoryview(pull_into.out).cast("B")) if pull_into is not None else None
        if ref is None and len(data) > self.slot_bytes:
            raise DataPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a push of {len(data)} bytes does not fit the local slot of {self.slot_bytes} bytes",
            )
        # Where the payload lies and its length as sent: the daemon refuses a header that says
        # another (its slot holds whatever was there before past the bytes written).
        place = ref if ref is not None else WindowPlace(0, 0, len(data))
        request = ps_pb2.DataRequest(push=push.header, authorization=self._authorization)
        place.into(request.local)
        if target is not None:
            target.into(request.pull_into)
            request.pull_dtype = pull_into.dtype
        # Fenced when the daemon may read or write our memory past a failure (_connection).
        with self._connection(timeout, fence=ref is not None or target is not None) as conn:
            if ref is None:
                conn.slot.write(data)
            self._sent()
            send_message(conn.sock, request)
            answer = _answer(conn.sock).push
        self._count(ref, len(data))
        if answer.pulled:
            with self._lock:
                self.pulls_carried += 1
        return answer

    def pull_batch(self, pulls: list[tuple[Pull, memoryview]], *, timeout: float) -> list[int | DataPlaneError] | None:
        """Each pull written into its `out` in one round trip (a DataBatch): per pull, the
        version received or the error its answer carried. None, with nothing sent, when an
        `out` is not in a window this daemon has: the caller pulls one at a time."""
        views = [memoryview(out).cast("B") for _, out in pulls]
        refs = [self._ref(view) for view in views]
        if any(ref is None for ref in refs):
            return None
        batch = self._new_batch(timeout)
        for (pull, _), ref in zip(pulls, refs, strict=True):
            request = batch.batch.requests.add()
            request.pull.CopyFrom(pull.request)
            ref.into(request.local)
        results: list[int | DataPlaneError] = []
        with self._connection(timeout + 5.0, fence=True) as conn:
            answers = self._batch(conn, batch)
            for (pull, _), view, answer in zip(pulls, views, answers, strict=True):
                if answer.code:
                    results.append(_error(answer))
                    continue
                try:
                    check_pull_header(answer.shard, len(view), pull.dtype, f"shard {pull.shard_id}")
                except PullStreamError as exc:
                    raise FrameError(str(exc)) from None  # the plan is wrong: close the connection
                results.append(answer.shard.version)
        for ref, result in zip(refs, results, strict=True):
            if not isinstance(result, DataPlaneError):
                self._count(ref, ref.nbytes)
        return results

    def push_batch(self, pushes: list[Push], *, timeout: float) -> list[ps_pb2.PushResponse | DataPlaneError] | None:
        """The pushes in one round trip (a DataBatch), applied in order: per push, the daemon's
        acknowledgement or the error its answer carried. None, with nothing sent, when a
        payload is not in a window this daemon has (an empty one, an APPLY's, needs none)."""
        places = []
        for push in pushes:
            data = memoryview(push.data).cast("B")
            ref = self._ref(data) if len(data) else WindowPlace(0, 0, 0)
            if ref is None:
                return None
            places.append(ref)
        batch = self._new_batch(timeout)
        for push, ref in zip(pushes, places, strict=True):
            request = batch.batch.requests.add()
            request.push.CopyFrom(push.header)
            ref.into(request.local)
        with self._connection(timeout, fence=True) as conn:
            answers = self._batch(conn, batch)
        results: list[ps_pb2.PushResponse | DataPlaneError] = []
        for ref, answer in zip(places, answers, strict=True):
            if answer.code:
                results.append(_error(answer))
            else:
                self._count(ref, ref.nbytes)
                results.append(answer.push)
        return results

    def _new_batch(self, timeout: float) -> ps_pb2.DataRequest:
        # Its requests are added in place (`batch.requests.add()`), not built apart and copied
        # in: each protobuf message built on its own is an arena of its own, and protobuf's
        # Python runtime calls malloc_trim(0) every 10,000 arena frees, handing this process's
        # whole free heap back to the kernel to be faulted in again (docs/benchmarks.md,
        # stream_overhead).
        batch = ps_pb2.DataRequest(authorization=self._authorization, timeout_ms=max(1, int(timeout * 1000)))
        batch.batch.SetInParent()  # a batch even with no requests in it
        return batch

    def _batch(self, conn: _Connection, batch: ps_pb2.DataRequest) -> list[ps_pb2.DataResponse]:
        sent = len(batch.batch.requests)
        self._sent()
        send_message(conn.sock, batch)
        answers = _answer(conn.sock).answers
        if len(answers) != sent:  # the daemon stopped at a fault of its own (INTERNAL), and closes
            last = f": {answers[-1].message}" if answers else ""
            raise FrameError(f"a batch of {sent} requests was answered {len(answers)} times{last}")
        return list(answers)

    def _sent(self) -> None:
        with self._lock:
            self.round_trips += 1

    def _count(self, ref: WindowPlace | None, nbytes: int) -> None:
        with self._lock:
            if ref is None:
                self.bytes_copied += nbytes
            else:
                self.bytes_in_place += nbytes

    def close(self) -> None:
        self._windows.remove_attacher(self.attach)
        while not self._idle.empty():
            self._closed(self._idle.get_nowait())


def _answer(sock: socket.socket) -> ps_pb2.DataResponse:
    """The daemon's answer; a status it answered with raises DataPlaneError (the connection stays usable)."""
    response = recv_message(sock, ps_pb2.DataResponse)
    if response.code:
        raise _error(response)
    return response


def _error(response: ps_pb2.DataResponse) -> DataPlaneError:
    return DataPlaneError(STATUS_CODES.get(response.code, grpc.StatusCode.UNKNOWN), response.message)
