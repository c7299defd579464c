"""A push whose payload is not the length its header announces is refused on every transport,
with INVALID_ARGUMENT and nothing applied: gRPC's chunked stream, the TCP data plane (whose
payload comes with its own length), and the local transport (whose request names how many
bytes were written for it). Issue 39: the data plane applied a RAW push of 4N declared bytes
sent with 4N + 1, and read the extra byte as the start of the next request.

Each case sends through the real transport (or raw frames, for a client of the older
protocol), then checks on the daemon that the shard is still at version 1 with the values of
the one step the fixture applied, and that the daemon still serves.
"""

from __future__ import annotations

import itertools
import socket

import grpc
import pytest
import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import frame, recv_message, send_message
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from ps_offload.trainer.wire.local_client import LocalClient
from tests.helpers.payloads import tensor_bytes

NUMEL = 1024
_names = itertools.count()
STEPPED = 1 - 0.1  # shard 0 after the fixture's one SGD step (lr 0.1) with gradient 1


@pytest.fixture(scope="module")
def daemon_address(tmp_path_factory):
    from ps_offload.daemon.local import LocalDaemon

    daemon = LocalDaemon(tmp_path_factory.mktemp("daemon"))
    yield daemon.address, daemon
    daemon.kill()


@pytest.fixture
def model(daemon_address):
    """A model of one shard at version 1 (one SGD step applied); its name, the gRPC client and
    the daemon's RegisterModelResponse."""
    address, _ = daemon_address
    name = f"len-{next(_names)}"
    client = DaemonClient(address, max_message_bytes=8 << 20)
    spec = ps_pb2.ModelSpec(
        model=name,
        params=[ps_pb2.ParamSpec(name="w", shape=[NUMEL], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.1)),
        shard_bytes=NUMEL * 4,
        daemons=["d0"],
    )
    response = client.register(spec, 0, timeout=10)
    client.push(Push.parameters(name, 0, tensor_bytes(torch.ones(NUMEL)), step=0), timeout=10)
    client.push(Push.gradient(name, 0, tensor_bytes(torch.ones(NUMEL)), step=0), timeout=10)
    yield name, client, response
    out = torch.empty(NUMEL)
    assert client.pull_into(Pull.of(name, 0, min_version=0), out=tensor_bytes(out), timeout=10) == 1  # nothing applied
    assert torch.equal(out, torch.full((NUMEL,), STEPPED))
    client.close()


def _mismatched(name: str, extra: int) -> Push:
    """Step 1's gradient push whose header announces NUMEL * 4 bytes and whose payload has
    `extra` more (fewer, if negative), as a client with a bug would send it."""
    header = Push.gradient(name, 0, tensor_bytes(torch.ones(NUMEL)), step=1).header
    return Push(header, memoryview(bytes(NUMEL * 4 + extra)))


def _refused(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


@pytest.mark.parametrize("extra", [1, -1], ids=["one-byte-more", "one-byte-fewer"])
def test_grpc(model, extra):
    name, client, _ = model
    details = _refused(lambda: client.push(_mismatched(name, extra), timeout=10))
    assert "more than the 4096 bytes" in details if extra > 0 else "ended after 4095 of 4096" in details


@pytest.mark.parametrize("extra", [1, -1], ids=["one-byte-more", "one-byte-fewer"])
def test_data_plane(model, extra):
    name, _, response = model
    data = DataPlaneClient("127.0.0.1", response.data_port, max_connections=1)
    try:
        details = _refused(lambda: data.push(_mismatched(name, extra), timeout=10))
        assert f"announces 4096 payload bytes and {4096 + extra} followed it; nothing applied" in details
        # The connection it came on was closed by the daemon; the next push takes another.
        ack = data.push(Push.gradient(name, 0, tensor_bytes(torch.ones(NUMEL)), step=0), timeout=10)
        assert not ack.applied and ack.version == 1
    finally:
        data.close()


def test_data_plane_a_client_of_the_older_protocol(model):
    """Raw bytes straight after `send_payload`, no length first, one more than announced:
    refused before any of them is applied, and the connection closed."""
    name, _, response = model
    with socket.create_connection(("127.0.0.1", response.data_port), timeout=10) as sock:
        send_message(sock, ps_pb2.DataRequest(push=_mismatched(name, 0).header))
        assert recv_message(sock, ps_pb2.DataResponse).send_payload
        sock.sendall(tensor_bytes(torch.full((NUMEL,), 2.0)).tobytes() + b"\x00")
        answer = recv_message(sock, ps_pb2.DataResponse)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "nothing applied" in answer.message
        assert sock.recv(1 << 16) == b"" or sock.recv(1) == b""  # closed by the daemon


@pytest.mark.parametrize("extra", [1, -1], ids=["one-byte-more", "one-byte-fewer"])
def test_local(model, extra):
    name, _, response = model
    local = LocalClient(response.local_endpoint, slot_bytes=2 * NUMEL * 4, max_connections=1)
    try:
        details = _refused(lambda: local.push(_mismatched(name, extra), timeout=10))
        assert f"{4096 + extra} bytes were written for it, its header says 4096; nothing applied" in details
    finally:
        local.close()


def test_local_a_push_that_names_no_place(model):
    """A push request without DataRequest.local (the older local protocol): refused."""
    name, _, response = model
    import fcntl
    import mmap
    import os

    fd = os.memfd_create("ps-offload-slot", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, NUMEL * 8)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    try:
        sock.connect("\0" + response.local_endpoint)
        socket.send_fds(sock, [frame(ps_pb2.DataRequest())], [fd])
        assert recv_message(sock, ps_pb2.DataResponse).code == 0
        slot = mmap.mmap(fd, NUMEL * 8)
        slot[: NUMEL * 4] = tensor_bytes(torch.full((NUMEL,), 2.0)).tobytes()
        send_message(sock, ps_pb2.DataRequest(push=_mismatched(name, 0).header))
        answer = recv_message(sock, ps_pb2.DataResponse)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "names no place" in answer.message
        slot.close()
    finally:
        sock.close()
        os.close(fd)
