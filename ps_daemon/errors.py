"""Typed errors of the daemon's domain: plain exceptions, no transport in sight. The store
raises them; the RPC layer (ps_offload.daemon.rpc.status) is the one place that turns them into
gRPC status codes, for the gRPC servicers and the TCP data plane alike.

Every message names the thing that is wrong and, where there is one, what to do instead.
"""

from __future__ import annotations


class PsError(Exception):
    """Something the daemon refuses or cannot do; a subclass says which kind."""


class NotFound(PsError):
    pass


class InvalidArgument(PsError):
    pass


class StreamOutOfStep(InvalidArgument):
    """Refused, and the connection closed after the answer: what follows on it can no longer
    be told apart from the next request (a data plane payload of another length than its
    header announced). `unread`: bytes the peer is still sending, read and dropped before the
    close so that it reads the answer instead of a reset."""

    def __init__(self, message: str, *, unread: int = 0) -> None:
        super().__init__(message)
        self.unread = unread


class FailedPrecondition(PsError):
    pass


class ResourceExhausted(PsError):
    pass


class DataLoss(PsError):
    pass


class StorageError(PsError):
    """The disk refused a write or read; the message says what was kept."""


class DeadlineExceeded(PsError):
    pass


class Unauthenticated(PsError):
    pass


class PermissionDenied(PsError):
    pass
