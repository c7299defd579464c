"""The one mapping between the domain's errors (ps_offload.daemon.errors) and gRPC status codes,
used by the gRPC servicers (the wrappers below) and the TCP data plane (`status_of`,
`from_status`), so both answer a refusal with the same code and message."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ps_offload.daemon.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PsError,
    ResourceExhausted,
    Unauthenticated,
)

log = logging.getLogger(__name__)

# StorageError and PsError itself are INTERNAL: the daemon failed, not the request.
STATUS_CODES: dict[type[PsError], grpc.StatusCode] = {
    NotFound: grpc.StatusCode.NOT_FOUND,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_of(exc: PsError) -> grpc.StatusCode:
    """The status code a domain error is answered with (a subclass: its nearest mapped base)."""
    for cls in type(exc).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


def from_status(code: grpc.StatusCode, message: str) -> PsError:
    """The typed error for a status code (those above; others as a plain PsError, INTERNAL)."""
    for cls, mapped in STATUS_CODES.items():
        if mapped == code:
            return cls(message)
    return PsError(message)


@dataclass(frozen=True)
class Undecodable:
    """What a request's deserializer returns for bytes that do not parse as its message, so
    the servicer answers INVALID_ARGUMENT itself: a deserializer that raised would get gRPC's
    own INTERNAL and an ERROR traceback in the log for each such request."""

    message: str  # the message type's full name
    reason: str

    @classmethod
    def decoder(cls, message_cls: type) -> Callable[[bytes], Any]:
        name = message_cls.DESCRIPTOR.full_name

        def decode(data: bytes) -> Any:
            try:
                return message_cls.FromString(data)
            except DecodeError as exc:
                return cls(name, str(exc).rpartition(": ")[2])  # protobuf names the type too

        return decode

    def error(self) -> InvalidArgument:
        return InvalidArgument(
            f"the request is not a valid {self.message} ({self.reason}): build it from proto/ps.proto"
        )


class RateLimitedLog:
    """At most one line per `interval` seconds for each (method, status): a client sending
    bad requests in a loop must not fill the disk with the same line. The next line says
    how many were left out."""

    def __init__(self, interval: float = 10.0, level: int = logging.INFO) -> None:
        self.interval = interval
        self.level = level
        self._last: dict[tuple[str, str], float] = {}
        self._dropped: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def info(self, method: str, code: str, message: str) -> None:
        key, now = (method, code), time.monotonic()
        with self._lock:
            if now - self._last.get(key, -math.inf) < self.interval:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return
            self._last[key] = now
            dropped = self._dropped.pop(key, 0)
        more = f" ({dropped} more like it in the last {self.interval:.0f}s not logged)" if dropped else ""
        log.log(self.level, "%s -> %s: %s%s", method, code, message, more)


_refusals = RateLimitedLog()


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, PsError):
        code = status_of(exc)
        _refusals.info(method, code.name, str(exc))
        context.abort(code, str(exc))
    log.exception("%s failed unexpectedly", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{method}: internal error: {type(exc).__name__}: {exc}")


def grpc_errors(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a unary or client-streaming servicer method: PsError -> its status code, any
    other exception -> INTERNAL with its text (and a logged traceback)."""

    @functools.wraps(handler)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            return handler(self, request, context)
        except grpc.RpcError:
            # The request stream itself failed (cancelled, or a message over the limit):
            # gRPC has set the status already.
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            if context.code() is not None:  # already aborted by grpc itself
                raise
            _abort(context, handler.__name__, exc)

    return wrapper


def grpc_errors_stream(handler: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """The same for server-streaming methods (generators)."""

    @functools.wraps(handler)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            yield from handler(self, request, context)
        except Exception as exc:  # noqa: BLE001
            _abort(context, handler.__name__, exc)

    return wrapper
