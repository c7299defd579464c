"""The daemon's TCP data plane: Pull and Push without gRPC's copies.

gRPC Python copies a streamed payload about four times on its way (the serializer must
return bytes, the core copies them, the receiver gets a fresh bytes per message); at
1-2 GB/s that is half of what loopback carries (docs/benchmarks.md). Here a pull is one
`sendall` straight from the shard's tensor and a push lands with `recv_into` in a staging
buffer (ps_offload.daemon.dataplane.requests). gRPC keeps everything else: registration, health,
admin, and the same Pull/Push as a fallback.

Threads are bounded, whatever the clients do. One thread watches every connection with a
selector (epoll): it accepts, runs TLS handshakes without blocking, gathers each request's
frame as its bytes come, and closes connections idle for `server.data_idle_seconds` (no next
request, or a frame or handshake stalled midway). A whole request goes to a fixed pool of
`server.data_workers` threads, which serve it on the blocking socket, each send or receive
bounded by `server.data_stall_seconds`, and hand the connection back. A pull waiting for a
version is parked on its shard, holding no thread, and given to a worker again when the
commit wakes it or its deadline passes; its client hanging up meanwhile ends it at once. So
thousands of connections, idle or waiting, cost a descriptor and some memory each, not a
thread, and waiting pulls cannot starve the pushes that would end their wait.

Limits, checked at accept before any work: `server.max_data_connections` open at once, and
`server.max_data_connections_per_client` from one address (all the ranks on a host share
it: an address is the one identity known before a handshake). One more is answered
RESOURCE_EXHAUSTED naming the limit (under TLS just closed: an answer would need the
handshake) and closed. A connection holds at most one request, so these bound the waiting
pulls too. With [tls] connections are TLS with the gRPC port's certificate (client
certificates under mutual TLS); with auth.require_token = "all" every request carries the
token, checked as gRPC's interceptor checks it (ps_offload.daemon.rpc.server_security).
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from google.protobuf.message import DecodeError

from ps_offload.daemon.config import ServerConfig
from ps_offload.daemon.dataplane.connections import Admission, Connection, ParkedDeadlines, Waker, quiet_log
from ps_offload.daemon.dataplane.requests import Outcome, PendingPull, RequestServer
from ps_offload.daemon.rpc.server_security import TokenCheck
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import FrameError, split_frame

log = logging.getLogger(__name__)

_READ_BYTES = 256 << 10
_LISTENER, _WAKE = object(), object()


class DataPlaneServer:
    def __init__(
        self,
        address: tuple[str, int],
        *,
        store: ShardStore,
        staging: StagingPool,
        limits: ServerConfig,
        tls: ssl.SSLContext | None = None,
        token: TokenCheck | None = None,
        observe: Callable[[str, grpc.StatusCode, float], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """limits: the [server] keys it follows (max_pull_wait_seconds, max_data_connections,
        max_data_connections_per_client, data_idle_seconds, data_stall_seconds, data_workers);
        tls: wrap connections (ps_offload.daemon.rpc.server_security.server_ssl_context); token:
        the [auth] rule; observe(method, code, seconds): told about every request (metrics);
        on_failure(why): told if the selector thread dies (the data plane is then gone, and
        the daemon must not look healthy)."""
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._listener = socket.create_server(address, family=family, backlog=1024)
        self._listener.setblocking(False)
        self.requests = RequestServer(
            store=store, staging=staging, max_pull_wait=limits.max_pull_wait_seconds, token=token, observe=observe
        )
        self.tls = tls
        self.admission = Admission(
            limits.max_data_connections, limits.max_data_connections_per_client, tls=tls is not None
        )
        self.idle_seconds = limits.data_idle_seconds
        self.stall_seconds = limits.data_stall_seconds
        self.stopping = False
        self.failure = ""  # why the selector thread died; "" while it runs
        self.on_failure = on_failure
        self._pool = ThreadPoolExecutor(max_workers=limits.data_workers, thread_name_prefix="data-plane-worker")
        self._selector = selectors.DefaultSelector()
        self._waker = Waker()
        self._handed_back: collections.deque[tuple] = collections.deque()  # from workers and commits
        self._deadlines = ParkedDeadlines()
        self._accepting_after = 0.0  # accept paused until then (out of descriptors)
        self._in_flight = 0
        self.parked_pulls = 0  # data plane pulls waiting for a version
        self._cond = threading.Condition()
        self._loop_ended = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def connections(self) -> int:
        return len(self.admission.connections)

    @property
    def refused(self) -> int:
        return self.admission.refused

    def peers(self) -> dict[str, int]:
        """Connections open now, by client address."""
        return self.admission.peers()

    def start(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._waker.reader, selectors.EVENT_READ, _WAKE)
        self._thread = threading.Thread(target=self._loop, name="data-plane", daemon=True)
        self._thread.start()

    def stop(self, grace: float) -> None:
        """Stops accepting, lets requests in progress finish for up to `grace` seconds, then
        closes every connection (idle and parked ones at once)."""
        self.stopping = True
        self._waker.wake()
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0, timeout=grace)
        self._handed_back.append(("stop", None, None))
        self._waker.wake()
        if self._thread is None or not self._loop_ended.wait(10):
            self._close_everything()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the selector thread ----------------------------------------------------------------

    def _loop(self) -> None:
        sweep_every, next_sweep = min(1.0, self.idle_seconds / 4), 0.0
        try:
            while True:
                now = time.monotonic()
                wait = next_sweep - now
                deadline = self._deadlines.next_deadline()
                if deadline is not None:
                    wait = min(wait, deadline - now)
                if self._accepting_after:
                    wait = min(wait, self._accepting_after - now)
                accept = False
                for key, _ in self._selector.select(max(wait, 0.0)):
                    if key.data is _LISTENER:
                        accept = True
                    elif key.data is _WAKE:
                        self._waker.drain()
                    else:
                        self._on_ready(key.data)
                if self._take_handed_back():
                    return
                if accept:  # last: connections that hung up meanwhile no longer count against the limits
                    self._accept()
                now = time.monotonic()
                if self.stopping:
                    self._stop_accepting()
                elif self._accepting_after and now >= self._accepting_after:
                    self._accepting_after = 0.0
                    self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
                for conn in self._deadlines.expired(now):
                    self._resume(conn)  # not woken: answered DEADLINE_EXCEEDED unless there by now
                if now >= next_sweep:
                    self._close_idle(now)
                    next_sweep = now + sweep_every
        except Exception as exc:  # noqa: BLE001 - the data plane must not die silently
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("data plane: the selector thread failed; closing every connection and accepting no more")
            if self.on_failure is not None:
                self.on_failure(self.failure)
        finally:
            self._close_everything()
            self._loop_ended.set()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # The pending connection stays queued: retry later rather than spin.
                    log.warning("data plane: cannot accept (%s); raise LimitNOFILE or lower max_data_connections", exc)
                    self._selector.unregister(self._listener)
                    self._accepting_after = time.monotonic() + 0.5
                    return
                log.info("data plane: accept failed: %s", exc)
                continue
            peer = address[0]
            if not self.admission.admit(sock, peer):
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            conn = Connection(sock, peer, time.monotonic())
            self.admission.opened(conn)
            if self.tls is None:
                self._watch(conn)
                continue
            conn.sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn.handshaking = True
            self._handshake(conn)

    def _handshake(self, conn: Connection) -> None:
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._watch(conn, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as exc:
            quiet_log.info("DataPlane", "handshake", f"TLS handshake with {conn.peer} failed: {exc}")
            self._close(conn)
            return
        conn.handshaking = False
        conn.last_active = time.monotonic()
        self._read(conn)  # a request may have come with the handshake's last flight

    def _on_ready(self, conn: Connection) -> None:
        if conn.closed:
            return
        if conn.handshaking:
            self._handshake(conn)
        elif conn.parked is not None:
            # One request at a time: bytes (or the end) while a pull waits mean the client has
            # given up on it. Unparked at once, so nothing waits for a reader who left.
            self._unpark(conn)
            self._close(conn)
        else:
            self._read(conn)

    def _read(self, conn: Connection) -> None:
        """Gathers what the socket has; hands a whole request to a worker."""
        while len(conn.inbox) <= 2 * _READ_BYTES:
            try:
                chunk = conn.sock.recv(_READ_BYTES)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except OSError as exc:
                quiet_log.info("DataPlane", "dropped", f"connection from {conn.peer}: {exc}")
                self._close(conn)
                return
            if not chunk:
                self._close(conn)  # hung up
                return
            conn.inbox += chunk
            conn.last_active = time.monotonic()
            if len(chunk) < _READ_BYTES and not (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending()):
                break
        try:
            body = split_frame(conn.inbox)
            request = None if body is None else ps_pb2.DataRequest.FromString(body)
        except (FrameError, DecodeError) as exc:  # not this protocol
            quiet_log.info("DataPlane", "closed", f"{conn.peer} sent what is not a DataRequest: {exc}")
            self._close(conn)
            return
        if request is None:
            self._watch(conn)
            return
        self._give_to_worker(conn, request, time.perf_counter(), None)

    def _give_to_worker(
        self, conn: Connection, request: ps_pb2.DataRequest, started: float, resumed: PendingPull | None
    ) -> None:
        self._unwatch(conn)
        conn.busy = True
        with self._cond:
            self._in_flight += 1
        self._pool.submit(self._work, conn, request, started, resumed)

    def _take_handed_back(self) -> bool:
        """Acts on what workers and commits handed back; True once the server is to stop."""
        while self._handed_back:
            what, conn, pending = self._handed_back.popleft()
            if what == "stop":
                return True
            if conn.closed:
                continue
            if what == "resume":
                if conn.parked is pending:  # else it ended already (deadline, hang-up)
                    pending.woken = True
                    self._resume(conn)
                continue
            conn.busy = False
            conn.last_active = time.monotonic()
            if what == "close" or self.stopping:
                self._close(conn)
            elif what == "park":
                self._park(conn, pending)
            else:  # the next request may be here already (read ahead, or inside TLS)
                self._read(conn)
        return False

    def _park(self, conn: Connection, pending: PendingPull) -> None:
        conn.parked = pending
        self.parked_pulls += 1
        self._deadlines.add(conn, pending, self.parked_pulls)
        wake = lambda: self._hand_back("resume", conn, pending)  # noqa: E731 - under the shard's lock: only queues
        shard = pending.checked.shard
        if shard.watch(pending.checked.pull.min_version, wake):
            pending.unwatch = lambda: shard.unwatch(wake)
            self._watch(conn)  # to see the client hang up
        else:  # there by now (or dropped: the worker answers why)
            pending.woken = True
            self._resume(conn)

    def _resume(self, conn: Connection) -> None:
        pending = conn.parked
        self._unpark(conn)
        self._give_to_worker(conn, pending.request, pending.started, pending)

    def _unpark(self, conn: Connection) -> None:
        pending, conn.parked = conn.parked, None
        if pending is None:
            return
        self.parked_pulls -= 1
        if pending.unwatch is not None and not pending.woken:
            pending.unwatch()

    def _close_idle(self, now: float) -> None:
        for conn in list(self.admission.connections):
            if conn.busy or conn.parked is not None:
                continue
            limit = self.stall_seconds if conn.handshaking else self.idle_seconds
            if now - conn.last_active > limit:
                self._close(conn)

    def _watch(self, conn: Connection, events: int = selectors.EVENT_READ) -> None:
        if conn.watched == events:
            return
        if conn.watched:
            self._selector.modify(conn.sock, events, conn)
        else:
            self._selector.register(conn.sock, events, conn)
        conn.watched = events

    def _unwatch(self, conn: Connection) -> None:
        if conn.watched:
            self._selector.unregister(conn.sock)
            conn.watched = 0

    def _close(self, conn: Connection) -> None:
        if conn.closed:
            return
        self._unwatch(conn)
        self._unpark(conn)
        conn.closed = True
        self.admission.closed(conn)
        try:
            conn.sock.close()
        except OSError:
            pass

    def _stop_accepting(self) -> None:
        if self._listener.fileno() >= 0:
            if not self._accepting_after:
                self._selector.unregister(self._listener)
            self._accepting_after = 0.0
            self._listener.close()
        for conn in list(self.admission.connections):
            if not conn.busy:  # idle, parked or mid-frame: nothing in progress to let finish
                self._close(conn)

    def _close_everything(self) -> None:
        for conn in list(self.admission.connections):
            if conn.busy:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)  # its worker sees the end and hands it back
                except OSError:
                    pass
            else:
                self._close(conn)
        if self._listener.fileno() >= 0:
            self._listener.close()

    # -- any thread ---------------------------------------------------------------------------

    def _hand_back(self, what: str, conn: Connection, pending: PendingPull | None = None) -> None:
        self._handed_back.append((what, conn, pending))
        self._waker.wake()

    def _work(self, conn: Connection, request: ps_pb2.DataRequest, started: float, resumed: PendingPull | None) -> None:
        """On a worker: serves one request with the socket blocking, each operation bounded by
        the stall timeout, then hands the connection back to the selector thread."""
        outcome: str | PendingPull = Outcome.CLOSE
        try:
            conn.sock.settimeout(self.stall_seconds)
            outcome = self.requests.serve(conn, request, started, resumed)
            conn.sock.setblocking(False)
        except OSError as exc:
            quiet_log.info("DataPlane", "dropped", f"connection from {conn.peer}: {exc}")
            outcome = Outcome.CLOSE
        except BaseException:
            log.exception("data plane: a worker failed")
            outcome = Outcome.CLOSE
        finally:
            if isinstance(outcome, PendingPull):
                self._hand_back("park", conn, outcome)
            else:
                self._hand_back(outcome, conn)
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
