"""What carries a shard's bytes between the trainer and one daemon.

Two transports implement it: the gRPC client (ps_offload.trainer.wire.sharded_client.
DaemonClient: chunked Push and Pull streams) and the data plane (ps_offload.trainer.wire.
dataplane_client.DataPlaneClient: a header, then the raw bytes, over pooled TCP connections).
ShardedClient picks one per daemon and retries through either the same way; a new transport
(shared memory for the node's own daemon) implements these three methods and nothing else.
"""

from __future__ import annotations

from typing import Protocol

from ps_offload.proto import ps_pb2
from ps_offload.proto.push import Push


class Transport(Protocol):
    def push(self, push: Push, *, timeout: float) -> ps_pb2.PushResponse:
        """Sends one push; the daemon's acknowledgement (applied, or a duplicate of a
        (shard, step) it applied before, without its payload). Errors are grpc.RpcErrors."""
        ...

    def pull_into(
        self,
        model: str,
        shard_id: int,
        *,
        min_version: int,
        out: memoryview,
        timeout: float,
        tensor: int = ps_pb2.MASTER,
        dtype: int = ps_pb2.FLOAT32,
    ) -> int:
        """Writes shard `shard_id`'s `tensor` in `dtype`, at `min_version` or later, into `out`
        (exactly its size in bytes); returns the version received."""
        ...

    def close(self) -> None: ...
