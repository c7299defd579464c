"""The TCP data plane against a real daemon: the same answers as the gRPC path for bad
input, nothing applied by a broken stream, garbage dropped without harm, SIGTERM drains."""

from __future__ import annotations

import itertools
import signal
import socket
import struct
import threading

import grpc
import pytest
import torch

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import PAYLOAD_LENGTH, recv_message, send_message
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient, DataPlaneError
from tests.helpers.data_plane import NUMEL, register_with_data_plane
from tests.helpers.payloads import tensor_bytes
from tests.helpers.waiting import until_stats

_models = itertools.count()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    """One daemon for the tests that leave it serving; each registers its own model."""
    daemon = LocalDaemon(tmp_path_factory.mktemp("daemon"))
    try:
        yield daemon
    finally:
        daemon.kill()


@pytest.fixture
def plane(shared_daemon):
    daemon, model = shared_daemon, f"m{next(_models)}"
    client, data, response = register_with_data_plane(daemon, model)
    client.close()
    for shard in response.shards:
        data.push(
            Push.parameters(model, shard.shard_id, tensor_bytes(torch.ones(shard.numel)), step=0),
            timeout=10,
        )
    ack = data.push(Push.gradient(model, 0, tensor_bytes(torch.ones(NUMEL)), step=0), timeout=10)
    assert ack.applied and ack.version == 1
    yield model, data, response
    # Still serving on both paths, and shard 0 holds exactly one SGD step: 1 - 0.1 * 1.
    out = torch.empty(NUMEL)
    assert data.pull_into(Pull.of(model, 0, min_version=1), out=tensor_bytes(out), timeout=10) == 1
    assert torch.equal(out, torch.full((NUMEL,), 1 - 0.1, dtype=torch.float32))
    grpc_out = torch.empty(NUMEL)
    assert client_pull(daemon, model, grpc_out) == 1 and torch.equal(grpc_out, out)
    data.close()


def client_pull(daemon, model, out):
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    try:
        return client.pull_into(Pull.of(model, 0, min_version=0), out=tensor_bytes(out), timeout=10)
    finally:
        client.close()


def _status(call):
    with pytest.raises(DataPlaneError) as info:
        call()
    return info.value.code(), info.value.details()


def test_bad_input_gets_the_same_statuses_as_grpc(plane):
    m, data, _ = plane
    code, details = _status(
        lambda: data.pull_into(Pull.of(m, 99, min_version=0), out=tensor_bytes(torch.empty(1)), timeout=5)
    )
    assert code == grpc.StatusCode.NOT_FOUND and "no shard 99" in details
    code, details = _status(lambda: data.push(Push.gradient(m, 0, tensor_bytes(torch.ones(10)), step=1), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "40 bytes" in details
    code, details = _status(lambda: data.push(Push.gradient(m, 0, tensor_bytes(torch.ones(NUMEL)), step=4), timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "step 4" in details
    code, _ = _status(
        lambda: data.pull_into(Pull.of(m, 0, min_version=9), out=tensor_bytes(torch.empty(NUMEL)), timeout=0.5)
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # A retried, already applied step: acknowledged without effect (the fixture checks values).
    ack = data.push(Push.gradient(m, 0, tensor_bytes(torch.full((NUMEL,), 9.0)), step=0), timeout=5)
    assert not ack.applied and ack.version == 1


def test_push_cut_off_mid_payload_applies_nothing(plane):
    m, _, response = plane
    with socket.create_connection(("127.0.0.1", response.data_port)) as sock:
        header = ps_pb2.PushHeader(model=m, shard_id=0, step=1, kind=ps_pb2.GRADIENT, encoding=ps_pb2.RAW,
                                   dtype=ps_pb2.FLOAT32, nbytes=NUMEL * 4)  # fmt: skip
        send_message(sock, ps_pb2.DataRequest(push=header))
        assert recv_message(sock, ps_pb2.DataResponse).send_payload
        sock.sendall(PAYLOAD_LENGTH.pack(NUMEL * 4) + bytes(NUMEL * 2))  # half the payload, then hang up
        sock.shutdown(socket.SHUT_WR)
        # The daemon closes its end once it has dropped the push: only then may the
        # fixture's teardown check that shard 0 is still at version 1.
        sock.settimeout(10)
        assert sock.recv(1) == b""


@pytest.mark.parametrize(
    "garbage",
    [b"\xff\xff\xff\xff", struct.pack("<I", 5) + b"\xff\xff\xff\xff\xff", b"GET / HTTP/1.1\r\n\r\n"],
    ids=["huge-frame", "malformed-message", "http"],
)
def test_garbage_closes_the_connection_and_harms_nothing(plane, garbage):
    _, _, response = plane
    with socket.create_connection(("127.0.0.1", response.data_port), timeout=5) as sock:
        sock.sendall(garbage)
        assert sock.recv(1) == b""  # closed by the daemon


def test_sigterm_lets_an_in_flight_data_plane_push_finish(daemon_factory, notifications):
    daemon = daemon_factory()
    numel = 4 << 20
    _, data, response = register_with_data_plane(daemon, numel=numel, shard_bytes=numel * 4)
    data.push(Push.parameters("m", 0, tensor_bytes(torch.zeros(numel)), step=0), timeout=10)
    sock = socket.create_connection(("127.0.0.1", response.data_port))
    header = ps_pb2.PushHeader(model="m", shard_id=0, step=0, kind=ps_pb2.GRADIENT, encoding=ps_pb2.RAW,
                               dtype=ps_pb2.FLOAT32, nbytes=numel * 4)  # fmt: skip
    send_message(sock, ps_pb2.DataRequest(push=header))
    assert recv_message(sock, ps_pb2.DataResponse).send_payload
    payload = tensor_bytes(torch.ones(numel))
    sock.sendall(PAYLOAD_LENGTH.pack(len(payload)))
    sock.sendall(payload[: len(payload) // 2])  # the daemon is reading the payload: in flight
    daemon.process.send_signal(signal.SIGTERM)
    notifications.wait_for("STOPPING=1")  # the drain has begun
    sender = threading.Thread(target=lambda: sock.sendall(payload[len(payload) // 2 :]))
    sender.start()
    answer = recv_message(sock, ps_pb2.DataResponse)
    sender.join(10)
    assert answer.code == 0 and answer.push.applied and answer.push.version == 1
    sock.close()
    assert daemon.process.wait(timeout=30) == 0
    data.close()


def test_connections_are_bounded_idle_ones_closed_and_the_trainer_reconnects_unseen(daemon_factory, tmp_path, caplog):
    """server.max_data_connections = 3: a fourth connection's request is answered
    RESOURCE_EXHAUSTED naming the limit; server.data_idle_seconds = 1: idle connections are
    closed (each seen closing here, not slept for), which frees room, and a trainer's pooled
    connection closed that way is replaced before its next pull without a retry."""
    config = tmp_path / "plane.toml"
    config.write_text("[server]\nmax_data_connections = 3\ndata_idle_seconds = 1.0\n")
    daemon = daemon_factory(config=config)
    client, data, response = register_with_data_plane(daemon)
    for shard in response.shards:
        data.push(Push.parameters("m", shard.shard_id, tensor_bytes(torch.ones(shard.numel)), step=0), timeout=10)
    data.close()
    until_stats(lambda stats: stats.data_connections == 0, "the pushes' connections closed", client)
    client.close()
    port = response.data_port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
    extra = socket.create_connection(("127.0.0.1", port), timeout=30)
    send_message(extra, ps_pb2.DataRequest(pull=ps_pb2.PullRequest(model="m", shard_id=0)))
    refusal = recv_message(extra, ps_pb2.DataResponse)
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "server.max_data_connections = 3" in refusal.message
    extra.close()
    for sock in idle:  # the daemon closes each after a second of silence: recv sees the end
        assert sock.recv(1) == b""
        sock.close()
    trainer_side = DataPlaneClient("127.0.0.1", port, max_connections=1)
    out = torch.empty(NUMEL)
    assert trainer_side.pull_into(Pull.of("m", 0, min_version=0), out=tensor_bytes(out), timeout=10) == 0
    pooled = trainer_side._idle.queue[0]
    pooled.settimeout(30)
    assert pooled.recv(1, socket.MSG_PEEK) == b""  # closed by the daemon while idle in the pool
    with caplog.at_level("WARNING"):
        assert trainer_side.pull_into(Pull.of("m", 1, min_version=0), out=tensor_bytes(out), timeout=10) == 0
    assert torch.equal(out, torch.ones(NUMEL)) and not caplog.records
    trainer_side.close()
