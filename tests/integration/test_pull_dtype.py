"""PullRequest.dtype against a real daemon, over gRPC and over the TCP data plane: a BFLOAT16
or FLOAT16 pull is the shard's fp32 master values cast by torch, bit for bit (ties, overflow,
subnormals, NaN, infinities, signed zeros), under a header that says so; Stats counts the
bytes actually sent; a narrow pull of optimizer state, or an unknown dtype, is INVALID_ARGUMENT
naming dtype, the same on both transports, and changes nothing."""

from __future__ import annotations

import dataclasses
import socket
import time

import grpc
import pytest
import torch

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import codec, ps_pb2, ps_pb2_grpc
from ps_offload.proto.frames import recv_exact_into, recv_message, send_message
from ps_offload.proto.push import Push
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from ps_offload.trainer.wire.local_client import LocalClient
from ps_offload.trainer.wire.sharded_client import ShardedClient
from tests.helpers.rounding_edges import edge_values

SHARD_BYTES = 4096  # 1024 elements: parameters of 1000 and 4097 make shards 1024 x 4 and 1001
SIZES = (1000, 4097)
TOTAL = sum(SIZES)
NARROW = {ps_pb2.BFLOAT16: torch.bfloat16, ps_pb2.FLOAT16: torch.float16}
TRANSPORTS = ("grpc", "tcp", "local")  # "tcp": the data plane; "local": the local transport
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def _spec(model: str) -> ps_pb2.ModelSpec:
    return ps_pb2.ModelSpec(
        model=model,
        params=[
            ps_pb2.ParamSpec(name="a", shape=[SIZES[0]], dtype=ps_pb2.FLOAT32),
            ps_pb2.ParamSpec(name="b", shape=[17, 241], dtype=ps_pb2.FLOAT32),
        ],
        optimizer=ps_pb2.OptimizerSpec(adamw=ps_pb2.AdamWSpec(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8)),
        shard_bytes=SHARD_BYTES,
    )


def _initial() -> torch.Tensor:
    """Random normals of several scales, with the edge values at both ends of every shard
    and across the boundary between the two parameters."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(TOTAL, generator=g) * torch.logspace(-6, 6, TOTAL)
    edges = edge_values()
    for start in range(0, TOTAL, SHARD_BYTES // 4):
        end = min(start + SHARD_BYTES // 4, TOTAL)
        values[start : start + len(edges)] = edges
        values[end - len(edges) : end] = edges.flip(0)
    values[SIZES[0] - 20 : SIZES[0] - 20 + len(edges)] = edges
    return values


INITIAL = _initial()


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


@dataclasses.dataclass
class Served:
    daemon: LocalDaemon
    data_port: int
    stepped: torch.Tensor  # model "stepped"'s master values after one AdamW step (version 1)

    def client(self, transport: str) -> ShardedClient:
        return ShardedClient([self.daemon.address], config=ClientConfig(transport=transport))

    def stats(self, *, pulls: int = 0) -> ps_pb2.StatsResponse:
        """The daemon's Stats, once it has counted `pulls` pulls: the data plane counts a pull
        after its last byte went out, which the trainer may have read a moment before."""
        deadline = time.monotonic() + 10
        with grpc.insecure_channel(self.daemon.address) as channel:
            while True:
                stats = ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10)
                if stats.pulls >= pulls or time.monotonic() > deadline:
                    return stats
                time.sleep(0.01)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One daemon with two models, both initialized to INITIAL: "init" at version 0, and
    "stepped" one AdamW step further (version 1)."""
    daemon = LocalDaemon(tmp_path_factory.mktemp("daemon"))
    try:
        client = ShardedClient([daemon.address], config=ClientConfig(transport="grpc"))
        for model in ("init", "stepped"):
            plan = client.register(_spec(model))
            for shard in plan:
                values = INITIAL[shard.offset : shard.offset + shard.numel].clone()
                ack = client.push(shard, Push.parameters(client.model, shard.shard_id, _view(values), step=0))
                assert ack.applied and ack.version == 0
        gradient = torch.randn(TOTAL, generator=torch.Generator().manual_seed(1))
        stepped = torch.empty(TOTAL)
        for shard in plan:  # "stepped", the last registered
            grad = gradient[shard.offset : shard.offset + shard.numel].clone()
            assert client.push(shard, Push.gradient(client.model, shard.shard_id, _view(grad), step=0)).version == 1
            out = stepped[shard.offset : shard.offset + shard.numel]
            assert client.pull(shard, min_version=1, out=_view(out)) == 1
        assert not torch.equal(stepped.view(torch.int32), INITIAL.view(torch.int32))
        client.close()
        spec = _spec("stepped")
        spec.daemons.append(daemon.address)
        grpc_client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        data_port = grpc_client.register(spec, 0, timeout=10).data_port
        grpc_client.close()
        assert data_port > 0
        yield Served(daemon, data_port, stepped)
    finally:
        daemon.kill()


@dataclasses.dataclass
class Answer:
    """A pull's answer as either transport gives it: status, header, bytes."""

    code: grpc.StatusCode
    details: str = ""
    header: ps_pb2.ShardHeader | None = None
    data: bytes = b""


def _grpc_pull(served: Served, request: ps_pb2.PullRequest) -> Answer:
    path = f"/{ps_pb2.DESCRIPTOR.services_by_name['ParameterServer'].full_name}/Pull"
    with grpc.insecure_channel(served.daemon.address) as channel:
        serialize, decode = ps_pb2.PullRequest.SerializeToString, codec.pull_chunks.decode
        call = channel.unary_stream(path, request_serializer=serialize, response_deserializer=decode)
        header, data = None, bytearray()
        try:
            for chunk in call(request, timeout=10):
                header = chunk.header if chunk.header is not None else header
                data += chunk.data
        except grpc.RpcError as error:
            return Answer(error.code(), error.details())
    return Answer(grpc.StatusCode.OK, header=header, data=bytes(data))


def _plane_pull(sock: socket.socket, request: ps_pb2.PullRequest) -> Answer:
    send_message(sock, ps_pb2.DataRequest(pull=request, timeout_ms=10_000))
    answer = recv_message(sock, ps_pb2.DataResponse)
    if answer.code:
        return Answer(_STATUS[answer.code], answer.message)
    data = bytearray(answer.shard.numel * (2 if answer.shard.dtype in NARROW else 4))
    recv_exact_into(sock, memoryview(data))
    return Answer(grpc.StatusCode.OK, header=answer.shard, data=bytes(data))


def _both(served: Served, request: ps_pb2.PullRequest) -> list[Answer]:
    """The answers of gRPC and of the data plane (on one connection, used again after)."""
    with socket.create_connection(("127.0.0.1", served.data_port), timeout=10) as sock:
        answers = [_grpc_pull(served, request), _plane_pull(sock, request)]
        # An answered refusal leaves the connection in step: the next pull on it is served.
        after = _plane_pull(sock, ps_pb2.PullRequest(model="init", shard_id=0))
        assert after.code == grpc.StatusCode.OK and after.data == _view(INITIAL[:1024]).tobytes()
    return answers


# -- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", list(NARROW), ids=lambda d: ps_pb2.DType.Name(d))
@pytest.mark.parametrize("model", ["init", "stepped"])
def test_a_narrow_pull_is_the_fp32_values_cast_by_torch_bit_for_bit(served, transport, dtype, model):
    fp32, version = (INITIAL, 0) if model == "init" else (served.stepped, 1)
    client = served.client(transport)
    try:
        plan = client.register(_spec(model))
        assert len(plan) == 5 and plan[-1].numel == 1001
        kind = {"grpc": DaemonClient, "tcp": DataPlaneClient, "local": LocalClient}[transport]
        assert isinstance(client.transports[0], kind)
        expected = fp32.to(NARROW[dtype])  # what the trainer would get pulling fp32 and casting
        for shard in plan:
            out = torch.empty(shard.numel, dtype=NARROW[dtype])
            # The client checks the header: this dtype, the shard's element count.
            assert client.pull(shard, min_version=version, out=_view(out), dtype=dtype) == version
            want = expected[shard.offset : shard.offset + shard.numel]
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), f"shard {shard.shard_id}"
        assert expected.isnan().any() and expected.isinf().any()  # the edge values are in there
    finally:
        client.close()


@pytest.mark.parametrize("dtype", [ps_pb2.DTYPE_UNSPECIFIED, ps_pb2.FLOAT32, ps_pb2.BFLOAT16, ps_pb2.FLOAT16])
def test_both_transports_send_the_same_header_and_bytes(served, dtype):
    for shard_id, numel in ((0, 1024), (4, 1001)):
        request = ps_pb2.PullRequest(model="stepped", shard_id=shard_id, min_version=1, dtype=dtype)
        grpc_answer, plane_answer = _both(served, request)
        assert grpc_answer == plane_answer
        header = grpc_answer.header
        sent = dtype or ps_pb2.FLOAT32
        assert (header.model, header.shard_id, header.version, header.numel, header.dtype) == (
            "stepped", shard_id, 1, numel, sent,
        )  # fmt: skip
        values = served.stepped[shard_id * 1024 : shard_id * 1024 + numel]
        assert grpc_answer.data == _view(values.to(NARROW.get(sent, torch.float32))).tobytes()


# -- Stats -----------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bytes_pulled_counts_the_bytes_sent(served, transport):
    client = served.client(transport)
    try:
        plan = client.register(_spec("init"))
        cases = [(ps_pb2.BFLOAT16, 2), (ps_pb2.FLOAT16, 2), (ps_pb2.FLOAT32, 4), (ps_pb2.DTYPE_UNSPECIFIED, 4)]
        for dtype, width in cases:
            for shard in (plan[0], plan[-1]):
                out = torch.empty(shard.numel * width, dtype=torch.uint8)
                before = served.stats()
                client.pull(shard, min_version=0, out=_view(out), dtype=dtype)
                after = served.stats(pulls=before.pulls + 1)
                assert after.bytes_pulled - before.bytes_pulled == width * shard.numel, ps_pb2.DType.Name(dtype)
                assert after.pulls - before.pulls == 1
    finally:
        client.close()


# -- refusals --------------------------------------------------------------------------------

REFUSED = [
    (ps_pb2.EXP_AVG, ps_pb2.BFLOAT16, "dtype bfloat16 is for master pulls only; pull exp_avg as float32"),
    (ps_pb2.EXP_AVG_SQ, ps_pb2.FLOAT16, "dtype float16 is for master pulls only; pull exp_avg_sq as float32"),
    (ps_pb2.MASTER, 99, "dtype 99 is unknown; ask for FLOAT32, BFLOAT16, FLOAT16"),
    (ps_pb2.EXP_AVG, 99, "dtype 99 is unknown; ask for FLOAT32, BFLOAT16, FLOAT16"),
    (ps_pb2.MASTER, -1, "dtype -1 is unknown"),
]


def _state(served: Served) -> list[tuple[int, bytes]]:
    """Every shard's (version, bytes) of each tensor of "stepped", pulled in fp32."""
    state = []
    for shard_id in range(5):
        for tensor in (ps_pb2.MASTER, ps_pb2.EXP_AVG, ps_pb2.EXP_AVG_SQ):
            answer = _grpc_pull(served, ps_pb2.PullRequest(model="stepped", shard_id=shard_id, tensor=tensor))
            assert answer.code == grpc.StatusCode.OK
            state.append((answer.header.version, answer.data))
    return state


@pytest.mark.parametrize(
    ("tensor", "dtype", "message"),
    REFUSED,
    ids=[f"{ps_pb2.ShardTensor.Name(t)}-{d}" for t, d, _ in REFUSED],
)
def test_a_bad_dtype_is_invalid_argument_on_both_transports_and_changes_nothing(served, tensor, dtype, message):
    before = _state(served)
    stats = served.stats()
    request = ps_pb2.PullRequest(model="stepped", shard_id=1, min_version=1, tensor=tensor, dtype=dtype)
    for answer in _both(served, request):
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
        assert "pull of shard 1" in answer.details and message in answer.details, answer.details
        assert answer.header is None and answer.data == b""
    after_stats = served.stats(pulls=stats.pulls + 1)
    # Only _both's one good pull of 1024 fp32 values on the data plane was counted.
    assert after_stats.pulls - stats.pulls == 1 and after_stats.bytes_pulled - stats.bytes_pulled == 4096
    assert _state(served) == before
    assert all(version == 1 for version, _ in before)
    assert served.daemon.process.poll() is None


def test_the_trainer_sees_a_refused_narrow_pull_as_invalid_argument(served):
    """Through the trainer's clients: not retried, and the code and message come through."""
    for transport in TRANSPORTS:
        client = served.client(transport)
        try:
            shard = client.register(_spec("stepped"))[2]
            out = torch.empty(shard.numel, dtype=torch.bfloat16)
            with pytest.raises(RuntimeError) as info:
                client.pull(shard, min_version=1, out=_view(out), tensor=ps_pb2.EXP_AVG, dtype=ps_pb2.BFLOAT16)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "dtype bfloat16 is for master pulls only" in str(info.value)
        finally:
            client.close()
