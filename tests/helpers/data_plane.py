"""A model registered over gRPC on a real daemon, with a TCP data-plane client to it: what
the data plane's tests push and pull through."""

from __future__ import annotations

from ps_offload.proto import ps_pb2
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient

NUMEL = 1024


def register_with_data_plane(daemon, model="m", numel=3 * NUMEL, shard_bytes=NUMEL * 4):
    """Registers SGD on one fp32 parameter; returns (the gRPC client, a data-plane client
    of 2 connections, the registration's response)."""
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    spec = ps_pb2.ModelSpec(
        model=model,
        params=[ps_pb2.ParamSpec(name="w", shape=[numel], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.1)),
        shard_bytes=shard_bytes,
        daemons=["d0"],
    )
    response = client.register(spec, 0, timeout=10)
    assert response.data_port > 0
    data = DataPlaneClient("127.0.0.1", response.data_port, max_connections=2)
    return client, data, response
