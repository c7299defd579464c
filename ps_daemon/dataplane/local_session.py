"""The local transport's connections, as the daemon sees them (ps_offload.daemon.dataplane.
local_server): a connection's session (its socket, the bytes read ahead, its client's id and
slot), the refusal that closes one, and who the peer is (SO_PEERCRED, its groups)."""

from __future__ import annotations

import os
import socket
import struct
import uuid
from pathlib import Path

import grpc

from ps_offload.daemon.dataplane.batch_runs import BatchRuns
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import FrameError, send_message, split_frame
from ps_offload.proto.shared_memory import SharedMapping

PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Refused(Exception):
    """The connection may not stay: answered with `code` and the message, then closed."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Session:
    """One connection: its socket, the bytes received and not yet parsed, its client's id
    and its slot."""

    def __init__(self, sock: socket.socket, pid: int, batch_runs: BatchRuns) -> None:
        self.sock = sock
        self.pid = pid
        self.batch_runs = batch_runs  # how its batches are served
        self.inbox = bytearray()
        self.client = ""
        self.slot: SharedMapping | None = None

    def receive(self) -> tuple[ps_pb2.DataRequest, list[int]]:
        """The next request, and the descriptors that came with it."""
        fds: list[int] = []
        try:
            while (body := split_frame(self.inbox)) is None:
                data, got, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
                fds += got
                if not data:
                    raise FrameError("hung up between requests" if not self.inbox else "hung up mid-frame")
                self.inbox += data
            return ps_pb2.DataRequest.FromString(body), fds
        except Exception as exc:
            close_fds(fds)
            if isinstance(exc, FrameError | OSError):
                raise
            raise FrameError(f"sent what is not a DataRequest: {exc}") from None

    def open(self, first: ps_pb2.DataRequest, fds: list[int]) -> None:
        """The first frame: an attach of window 0 (or an empty request) with the slot's memfd."""
        kind = first.WhichOneof("kind")
        if kind not in (None, "attach") or first.attach.window or len(fds) != 1 or len(first.attach.client) > 64:
            close_fds(fds)
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the first frame on the local endpoint must attach window 0 (a client id of at most 64 "
                f"characters) with exactly one fd, the client's memfd slot (SCM_RIGHTS); it carried {len(fds)}",
            )
        try:
            self.slot = SharedMapping(fds[0])
        except ValueError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the local slot: {exc}") from None
        finally:
            os.close(fds[0])
        self.client = first.attach.client or f"connection-{uuid.uuid4().hex}"


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def process_groups(pid: int) -> set[int]:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone already
        return set()
    for line in status.splitlines():
        if line.startswith("Groups:"):
            return {int(g) for g in line.split()[1:]}
    return set()


def refuse(sock: socket.socket, refusal: Refused) -> None:
    try:
        sock.settimeout(1.0)
        send_message(sock, ps_pb2.DataResponse(code=refusal.code.value[0], message=str(refusal)))
    except OSError:
        pass
    finally:
        sock.close()
