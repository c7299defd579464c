"""Framing for the TCP data plane (see DataRequest in proto/ps.proto): a 4-byte
little-endian length, then a serialized message; a push's payload follows as its 8-byte
little-endian length (PAYLOAD_LENGTH, as the sender counts the bytes it sends), then the raw
bytes, read with recv_into straight into their destination. The daemon refuses a payload whose
length is not the one its header announced: a longer one's tail would otherwise be read as
the next request after the push was applied."""

from __future__ import annotations

import socket
import struct
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)

_LENGTH = struct.Struct("<I")
PAYLOAD_LENGTH = struct.Struct("<Q")
MAX_FRAME_BYTES = 64 << 10  # headers only; payloads are not framed


class FrameError(ConnectionError):
    """The peer sent something that is not a frame of this protocol, or hung up."""


def frame(message: Message) -> bytes:
    """`message` as one frame: its length, then its bytes."""
    raw = message.SerializeToString()
    return _LENGTH.pack(len(raw)) + raw


def send_message(sock: socket.socket, message: Message) -> None:
    sock.sendall(frame(message))


def send_payload(sock: socket.socket, data: memoryview) -> None:
    """A push's payload: its length, then its bytes."""
    sock.sendall(PAYLOAD_LENGTH.pack(len(data)))
    sock.sendall(data)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from the socket; raises FrameError if the peer hangs up first."""
    received, total = 0, len(view)
    while received < total:
        n = sock.recv_into(view[received:], total - received)
        if n == 0:
            raise FrameError(f"connection closed after {received} of {total} bytes")
        received += n


def recv_message(sock: socket.socket, cls: type[M]) -> M:
    head = bytearray(_LENGTH.size)
    recv_exact_into(sock, memoryview(head))
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit: not this protocol?")
    body = bytearray(length)
    recv_exact_into(sock, memoryview(body))
    try:
        return cls.FromString(bytes(body))
    except DecodeError as exc:
        raise FrameError(f"malformed {cls.__name__}: {exc}") from exc


def split_frame(inbox: bytearray) -> bytes | None:
    """The body of the first whole frame in `inbox`, removed from it; None while the frame
    is still incomplete. For a reader that gathers bytes as they come (the daemon's data plane
    reads without blocking)."""
    if len(inbox) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(inbox)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit: not this protocol?")
    end = _LENGTH.size + length
    if len(inbox) < end:
        return None
    body = bytes(inbox[_LENGTH.size : end])
    del inbox[:end]
    return body


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)
