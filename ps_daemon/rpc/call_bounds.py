"""Bounds on what one gRPC call can hold, whatever its client does.

gRPC's sync server gives each call a thread (`server.max_workers` of them) from the moment
it is dispatched. A client that sends a call's headers and then half its request, or never
its message, or stops reading a streamed answer, holds that thread for as long as it likes:
enough of them and health checks, registrations and every other trainer wait behind them
(the systemd watchdog then kills a daemon that is fine). Two bounds, applied to every
method (health and reflection included) by one server interceptor:

* **Threads, per client.** At most `server.max_calls_per_client` calls from one client
  address run at once (default: half of max_workers); one more is answered at once with
  RESOURCE_EXHAUSTED, marked busy (trailing metadata `ps-retry: busy`, which the trainer's
  client retries with backoff). Other hosts, and the watchdog's own health checks on their
  private socket, keep the rest. Health checks have a budget of their own
  (HEALTH_CALLS_PER_CLIENT), so that a prober on the host of a misbehaving client (a
  kubelet, `grpc_health_probe`) is still answered.
* **Time, per stall.** A call waiting on its client (for the next request message, or for
  the client to take the next chunk of the answer) for `server.data_stall_seconds` is
  cancelled, and its thread freed. Time spent in the daemon's own work (a pull waiting for
  its version, bounded by max_pull_wait_seconds; a commit) is not the client's and does
  not count.

To see the wait for a request, every method is served as if its requests streamed: gRPC then
hands the call to the handler before its message has arrived, and the first message is read
here, under the watch (a unary client sends the same bytes either way).

Why not `grpc.aio`, where a stalled call is a parked coroutine and holds no thread: the
store's work blocks (locks, O_DIRECT I/O, waits on versions), so under asyncio it would run
in a thread pool all the same, behind a rewrite of every handler and interceptor. What only
a client controls is receiving a request and sending an answer; those are what is bounded
here (measured in docs/reliability.md).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from ps_offload.daemon.rpc.status import RateLimitedLog
from ps_offload.daemon.store.pull_wait import client_address
from ps_offload.proto.channel import BUSY_METADATA

log = logging.getLogger(__name__)
_cancellations = RateLimitedLog()
HEALTH_SERVICE = "/grpc.health.v1.Health/"
HEALTH_CALLS_PER_CLIENT = 2


@dataclass(eq=False)
class _Call:
    context: grpc.ServicerContext
    method: str
    budget: tuple[str, bool]  # (client address, a health check)
    waiting_since: float | None = field(default=None)  # monotonic; None while the daemon works
    cancelled: bool = False


class CallBounds(grpc.ServerInterceptor):
    """The interceptor; `start()` runs the thread that cancels stalled calls."""

    def __init__(self, *, per_client: int, stall_seconds: float) -> None:
        self.per_client = per_client
        self.stall_seconds = stall_seconds
        self.refused = 0  # calls answered busy
        self.cancelled = 0  # calls cut off for a stall
        self._calls: set[_Call] = set()
        self._per_client: collections.Counter[tuple[str, bool]] = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rpc-stalls", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    # -- the interceptor ----------------------------------------------------------------

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        health = handler_call_details.method.startswith(HEALTH_SERVICE)
        inner = (
            handler.stream_unary or handler.stream_stream
            if handler.request_streaming
            else handler.unary_unary or handler.unary_stream
        )
        if handler.response_streaming:
            serve, make = _stream_replies, grpc.stream_stream_rpc_method_handler
        else:
            serve, make = _one_reply, grpc.stream_unary_rpc_method_handler
        return make(
            serve(self, method, health, inner, handler.request_streaming),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    # -- accounting ---------------------------------------------------------------------

    def _admit(self, context: grpc.ServicerContext, method: str, health: bool) -> _Call:
        client = client_address(context.peer())
        budget, limit = (client, health), HEALTH_CALLS_PER_CLIENT if health else self.per_client
        with self._lock:
            if self._per_client[budget] >= limit:
                self.refused += 1
                what = "health checks" if health else "calls"
                refusal = (
                    f"{method}: {limit} {what} from {client} are running on this daemon already"
                    f"{'' if health else ' (server.max_calls_per_client)'}; retry shortly"
                )
            else:
                call = _Call(context, method, budget)
                self._calls.add(call)
                self._per_client[budget] += 1
                return call
        context.set_trailing_metadata((BUSY_METADATA,))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        raise AssertionError("unreachable: abort raises")

    def _leave(self, call: _Call) -> None:
        with self._lock:
            self._calls.discard(call)
            self._per_client[call.budget] -= 1
            if not self._per_client[call.budget]:
                del self._per_client[call.budget]

    def _requests(self, call: _Call, requests: Iterator) -> Iterator:
        while True:
            call.waiting_since = time.monotonic()
            try:
                request = next(requests)
            except StopIteration:
                return
            finally:
                call.waiting_since = None
            yield request

    def _watch(self) -> None:
        every = min(1.0, self.stall_seconds / 4)
        while not self._stop.wait(every):
            now = time.monotonic()
            with self._lock:
                stalled = [
                    c
                    for c in self._calls
                    if not c.cancelled and c.waiting_since is not None and now - c.waiting_since > self.stall_seconds
                ]
                for call in stalled:
                    call.cancelled = True
                self.cancelled += len(stalled)
            for call in stalled:
                _cancellations.info(
                    call.method,
                    "CANCELLED",
                    f"cut off a call from {call.budget[0]}: its client moved no bytes for {self.stall_seconds:.0f}s "
                    "(server.data_stall_seconds)",
                )
                call.context.cancel()


def _first(bounds: CallBounds, call: _Call, requests: Iterator, streaming: bool):
    """What the inner behaviour takes: the watched request iterator, or its one message."""
    watched = bounds._requests(call, requests)
    if streaming:
        return watched
    request = next(watched, None)
    if request is None:
        call.context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{call.method}: the call ended without its request")
    return request


def _one_reply(bounds: CallBounds, method: str, health: bool, inner: Callable, streaming: bool) -> Callable:
    def behaviour(requests, context):
        call = bounds._admit(context, method, health)
        try:
            return inner(_first(bounds, call, requests, streaming), context)
        finally:
            bounds._leave(call)

    return behaviour


def _stream_replies(bounds: CallBounds, method: str, health: bool, inner: Callable, streaming: bool) -> Callable:
    def behaviour(requests, context):
        call = bounds._admit(context, method, health)
        try:
            for reply in inner(_first(bounds, call, requests, streaming), context):
                # gRPC sends it before asking for the next: until then the client has it.
                call.waiting_since = time.monotonic()
                yield reply
                call.waiting_since = None
        finally:
            bounds._leave(call)

    return behaviour
