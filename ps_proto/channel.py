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


def keepalive_options(dead_peer_seconds: float) -> list[tuple[str, int]]:
    """A caller's channel options that fail its calls UNAVAILABLE (so they are retried) within
    about `dead_peer_seconds` when the peer stops answering without a reset (a partition, a
    host gone): HTTP/2 pings every half of it while calls are in flight, each to be answered
    within the other half, and connect attempts given up after all of it. The daemon accepts
    the pings (SERVER_KEEPALIVE)."""
    half_ms = max(500, int(dead_peer_seconds * 500))
    return [
        # A connect attempt unanswered (SYNs dropped) fails after dead_peer_seconds, not 20 s.
        ("grpc.min_reconnect_backoff_ms", 2 * half_ms),
        ("grpc.keepalive_time_ms", half_ms),
        ("grpc.keepalive_timeout_ms", half_ms),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]


# The daemon's side: accept a caller's pings as often as every second even while a call sends
# no data (a pull waiting for its version), instead of answering them with GOAWAY.
# The protocol this release speaks (RegisterModelResponse.protocol), raised when a trainer
# comes to need what older daemons lack, and the oldest daemon protocol its trainer accepts.
# 2: a data plane push's payload comes with its length, a local push always names its place
# and length (issue 39: a payload longer than its header was applied); 1 and 2 cannot mix.
# 3: the local transport takes batches (DataBatch); a trainer sends them only to a daemon of
# 3 or later, and to one of 2 its requests one by one.
PROTOCOL = 3
BATCHES_PROTOCOL = 3
MIN_DAEMON_PROTOCOL = 2

# Trailing metadata of a RESOURCE_EXHAUSTED that only says "busy now" (too many calls from one
# client at once: ps_daemon/rpc/call_bounds.py): the trainer retries it with backoff, where a
# RESOURCE_EXHAUSTED without it (a full disk, a budget) is final.
BUSY_METADATA = ("ps-retry", "busy")
SERVER_KEEPALIVE = [("grpc.http2.min_ping_interval_without_data_ms", 1000), ("grpc.http2.max_ping_strikes", 0)]
