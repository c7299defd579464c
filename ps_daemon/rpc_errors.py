"""The one mapping between the domain's errors (ps_daemon.errors) and gRPC status codes,
used by the gRPC servicers (the wrappers below) and the TCP data plane (`status_of`,
`from_status`), so both answer a refusal with the same code and message."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

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


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, PsError):
        code = status_of(exc)
        log.info("%s -> %s: %s", method, code.name, exc)
        context.abort(code, str(exc))
    log.exception("%s failed unexpectedly", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{method}: internal error: {type(exc).__name__}: {exc}")


def grpc_errors(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a unary or client-streaming servicer method: PsError -> its status code, any
    other exception -> INTERNAL with its text (and a logged traceback)."""

    @functools.wraps(handler)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
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
            yield from handler(self, request, context)
        except Exception as exc:  # noqa: BLE001
            _abort(context, handler.__name__, exc)

    return wrapper
