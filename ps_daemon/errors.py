"""Typed errors of the daemon's domain. The store raises them; one place (the servicer's
error wrapper) turns them into gRPC status codes, so the store never imports grpc.

Every message names the thing that is wrong and, where there is one, what to do instead.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

log = logging.getLogger(__name__)


class PsError(Exception):
    code = grpc.StatusCode.INTERNAL


class NotFound(PsError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(PsError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(PsError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(PsError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLoss(PsError):
    code = grpc.StatusCode.DATA_LOSS


class StorageError(PsError):
    """The disk refused a write or read; the message says what was kept."""

    code = grpc.StatusCode.INTERNAL


class DeadlineExceeded(PsError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(PsError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(PsError):
    code = grpc.StatusCode.PERMISSION_DENIED


def from_status(code: grpc.StatusCode, message: str) -> PsError:
    """The typed error for a status code (those above; others as INTERNAL)."""
    for cls in (NotFound, InvalidArgument, FailedPrecondition, ResourceExhausted, DataLoss, DeadlineExceeded,
                Unauthenticated, PermissionDenied):  # fmt: skip
        if cls.code == code:
            return cls(message)
    return PsError(message)


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, PsError):
        log.info("%s -> %s: %s", method, exc.code.name, exc)
        context.abort(exc.code, str(exc))
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
