"""What both ends of a gRPC channel must agree on: message limits, the chunk size of
streamed tensors, and the services and method paths the contract declares (read from the
generated descriptors, so they cannot drift from proto/ps.proto)."""

from __future__ import annotations

from ps_offload.proto import ps_pb2

CHUNK_BYTES = 1 << 20
"""Bytes of tensor data per streamed Pull/Push message: large enough that per-message costs
vanish, far below any message limit."""

SERVICE_NAMES = [ps_pb2.DESCRIPTOR.services_by_name[name].full_name for name in ("ParameterServer", "Admin")]


def method_path(service: str, method: str) -> str:
    """The gRPC path of `service`.`method` ("/ps.v1.Admin/Evict"); KeyError if the contract
    declares no such method."""
    descriptor = ps_pb2.DESCRIPTOR.services_by_name[service]
    return f"/{descriptor.full_name}/{descriptor.methods_by_name[method].name}"


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options both ends use: message limits, and no compression of already-dense floats."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
