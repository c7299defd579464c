"""SIGTERM: the daemon stops taking calls, lets in-flight pushes finish, and exits 0."""

from __future__ import annotations

import signal
import threading

import grpc
import torch

from ps_offload.proto import codec, ps_pb2, ps_pb2_grpc
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient

NUMEL = 4 << 20  # 16 MiB shard: 16 chunks


def test_sigterm_finishes_in_flight_push_and_exits_zero(daemon_factory, notifications):
    daemon = daemon_factory()
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    spec = ps_pb2.ModelSpec(
        model="m",
        params=[ps_pb2.ParamSpec(name="w", shape=[NUMEL], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=1.0)),
        shard_bytes=NUMEL * 4,
        daemons=["d0"],
    )
    client.register(spec, 0, timeout=10)
    values = memoryview(torch.zeros(NUMEL).numpy()).cast("B")
    client.push(Push.parameters("m", 0, values, step=0), timeout=10)

    header = ps_pb2.PushHeader(
        model="m",
        shard_id=0,
        step=0,
        kind=ps_pb2.GRADIENT,
        encoding=ps_pb2.RAW,
        dtype=ps_pb2.FLOAT32,
        nbytes=NUMEL * 4,
    )
    grad = memoryview(torch.ones(NUMEL).numpy()).cast("B")
    first_chunk_sent, drain_started = threading.Event(), threading.Event()

    def held_chunks():
        # A push that is still streaming when SIGTERM arrives: the first of its 16 chunks,
        # then the rest once the daemon has begun to drain.
        for i, start in enumerate(range(0, len(grad), 1 << 20)):
            yield codec.push_chunks.encode(header if i == 0 else None, grad[start : start + (1 << 20)])
            if i == 0:
                first_chunk_sent.set()
                assert drain_started.wait(30)

    result = {}
    pusher = threading.Thread(target=lambda: result.setdefault("ack", client._push(held_chunks(), timeout=30)))
    pusher.start()
    assert first_chunk_sent.wait(10)
    # A call started after the push, on the same connection, answered: the daemon has taken
    # the push's stream (HTTP/2 streams open in order), so it is in progress, not queued.
    ps_pb2_grpc.AdminStub(client.channel).Stats(ps_pb2.StatsRequest(), timeout=10)
    daemon.process.send_signal(signal.SIGTERM)
    notifications.wait_for("STOPPING=1")
    drain_started.set()
    pusher.join(30)

    assert result["ack"].applied and result["ack"].version == 1
    assert daemon.process.wait(timeout=30) == 0
    assert "received SIGTERM" in daemon.log() and "stopped" in daemon.log()
    # The daemon is gone: new calls fail as unreachable, they do not hang.
    try:
        client.pull_into(Pull.of("m", 0, min_version=0), out=memoryview(bytearray(NUMEL * 4)), timeout=3)
        raise AssertionError("pull succeeded after shutdown")
    except grpc.RpcError as error:
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    client.close()
