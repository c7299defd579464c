"""What carries a shard's bytes between the trainer and one daemon.

Three transports implement it: the gRPC client (ps_offload.trainer.wire.daemon_client.
DaemonClient: chunked Push and Pull streams), the data plane (ps_offload.trainer.wire.
dataplane_client.DataPlaneClient: a header, then the raw bytes, over pooled TCP connections)
and the local transport (ps_offload.trainer.wire.local_client.LocalClient: headers over a Unix
socket, the bytes through a shared-memory slot, for the node's own daemon). ShardedClient
picks one per daemon and retries through any of them the same way; a new transport
implements these three methods and nothing else (a push's `pull_into` it may ignore).

A transport may also send batches, a daemon's pulls or pushes in one round trip: the local
one does (`LocalClient.pull_batch` and `push_batch`, proto DataBatch). ShardedClient uses them
where both are there (`ShardedClient.batches`), and sends alone whatever a batch did not
carry through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ps_offload.proto import ps_pb2
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push


@dataclass(frozen=True)
class PullInto:
    """Where a push would have its shard's new version go as well, as a pull of it in `dtype`
    (proto DType) would write it: exactly the shard's numel of that dtype. Only the local
    transport can (DataRequest.pull_into, when `out` lies in a window the daemon has)."""

    out: memoryview
    dtype: int


class Transport(Protocol):
    def push(self, push: Push, *, timeout: float, pull_into: PullInto | None = None) -> ps_pb2.PushResponse:
        """Sends one push; the daemon's acknowledgement (applied, or a duplicate of a
        (shard, step) it applied before, without its payload). `pull_into`: where the new
        version should go too; the answer's `pulled` says whether it went there (else the
        caller pulls). Errors are grpc.RpcErrors."""
        ...

    def pull_into(self, pull: Pull, *, out: memoryview, timeout: float) -> int:
        """Writes what `pull` asks for (a shard's tensor in a dtype, at a version or later) into
        `out` (exactly its size in bytes); returns the version received."""
        ...

    def close(self) -> None: ...
