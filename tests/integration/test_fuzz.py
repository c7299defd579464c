"""Property-based fuzzing of a real daemon (NVMe tier on): every RPC with hostile messages
built from proto/ps.proto (tests/helpers/fuzz_inputs.py), pushes with hostile headers and
payloads, raw bytes on every method, and raw bytes and hostile requests on the TCP data plane.

What must hold for every input: the daemon answers (no crash, no hang: each call has a
deadline, and only a Pull, which waits for a version by design, may run into it), with a
status a client can act on, never INTERNAL or UNKNOWN (an unhandled error), and writes no
traceback to its log. After every batch and at the end: health SERVING, and a model
trained before the fuzzing ("kept") is bit for bit as it was.

The budget: FUZZ_EXAMPLES examples per property (default 60 here; `make fuzz` runs 2,000
each: over 14,000 requests)."""

from __future__ import annotations

import os
import socket

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.frames import recv_message, send_message
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from tests.helpers import fuzz_inputs as fuzz
from tests.helpers.payloads import tensor_bytes
from tests.helpers.specs import sgd_spec

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
CHECK_EVERY = 25
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
SHARDS = (1024, 1024, 952)
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip

UNARY = {
    "/ps.v1.ParameterServer/RegisterModel": ps_pb2.RegisterModelRequest,
    "/ps.v1.ParameterServer/Prefetch": ps_pb2.PrefetchRequest,
    "/ps.v1.Admin/ListShards": ps_pb2.ListShardsRequest,
    "/ps.v1.Admin/GetShard": ps_pb2.GetShardRequest,
    "/ps.v1.Admin/Stats": ps_pb2.StatsRequest,
    "/ps.v1.Admin/Evict": ps_pb2.GetShardRequest,
    "/ps.v1.Admin/Load": ps_pb2.GetShardRequest,
    "/ps.v1.Admin/ListModels": ps_pb2.ListModelsRequest,
    "/ps.v1.Admin/GetModel": ps_pb2.GetModelRequest,
    "/ps.v1.Admin/DropModel": ps_pb2.DropModelRequest,  # never of the kept model (fuzz_inputs.KEPT_READERS)
    "/ps.v1.Admin/ListSnapshots": ps_pb2.ListSnapshotsRequest,
    "/ps.v1.Admin/DeleteSnapshot": ps_pb2.DeleteSnapshotRequest,
    # (CreateSnapshot waits for its step, up to the caller's deadline: tests/integration/test_snapshots.py)
}
STREAMING = {"/ps.v1.ParameterServer/Pull": ps_pb2.PullRequest, "/ps.v1.Admin/Verify": ps_pb2.VerifyRequest}


class Target:
    """The daemon under fuzz, its kept model's bytes, and the checks run between batches."""

    def __init__(self, daemon: LocalDaemon) -> None:
        self.daemon = daemon
        self.client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        self.calls = 0
        for name in (fuzz.KEPT, fuzz.FUZZ):
            self.client.register(sgd_spec(model=name, lr=0.1), 0, timeout=30)
            for shard_id, n in enumerate(SHARDS):
                values = tensor_bytes(torch.linspace(-1, 1, n) + shard_id)
                self.client.push(Push.parameters(name, shard_id, values, step=0), timeout=30)
        grad = tensor_bytes(torch.full((1024,), 0.5))
        self.client.push(Push.gradient(fuzz.KEPT, 0, grad, step=0), timeout=30)
        self.kept = self._kept_state()

    def _kept_state(self) -> list[tuple[int, bytes]]:
        state = []
        for shard_id, n in enumerate(SHARDS):
            out = torch.empty(n)
            version = self.client.pull_into(
                Pull.of(fuzz.KEPT, shard_id, min_version=0), out=tensor_bytes(out), timeout=30
            )
            state.append((version, out.numpy().tobytes()))
        return state

    def answered(self, call) -> None:
        """Runs one fuzzed call; any answer but an unhandled error is fine."""
        try:
            call()
        except grpc.RpcError as error:
            assert error.code() not in FORBIDDEN, (error.code(), error.details())
        self.calls += 1
        if self.calls % CHECK_EVERY == 0:
            self.check()

    def check(self) -> None:
        assert self.daemon.process.poll() is None, "the daemon died"
        health = health_pb2_grpc.HealthStub(self.client.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert self._kept_state() == self.kept, "the kept model changed"
        log = self.daemon.log()
        assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:3000]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fuzz")
    daemon = LocalDaemon(workdir / "d", "--nvme-dir", str(workdir / "nvme"))
    try:
        yield Target(daemon)
    finally:
        daemon.kill()


def _readers_only(method: str) -> bool:
    return method.rsplit("/", 1)[1] in fuzz.KEPT_READERS


@st.composite
def _calls(draw, methods: dict):
    """(method, hostile request): the kept model may be named only by calls that read it."""
    method = draw(st.sampled_from(sorted(methods)))
    return method, draw(fuzz.messages(methods[method].DESCRIPTOR, kept=_readers_only(method)))


@FUZZ_SETTINGS
@given(call=_calls(UNARY))
def test_unary_calls_with_hostile_messages(target, call):
    method, request = call
    stub = target.client.channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString())
    target.answered(lambda: stub(request, timeout=20))


@FUZZ_SETTINGS
@given(call=_calls(STREAMING))
def test_streaming_calls_with_hostile_messages(target, call):
    method, request = call
    stub = target.client.channel.unary_stream(method, request_serializer=lambda m: m.SerializeToString())

    def pull_or_verify() -> None:
        try:
            list(stub(request, timeout=3))
        except grpc.RpcError as error:
            if not (method.endswith("/Pull") and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
                raise  # (a Pull waits for its version: running into the deadline is its answer)

    target.answered(pull_or_verify)


@st.composite
def _pushes(draw):
    header = draw(fuzz.messages(ps_pb2.PushHeader.DESCRIPTOR))
    if header.model == fuzz.KEPT:  # (never: names() leaves it out; a valid push could change it)
        header.model = fuzz.FUZZ
    if draw(st.booleans()):  # often the fuzz model's real shards, so deeper checks are reached
        header.model, header.shard_id = fuzz.FUZZ, draw(st.integers(0, len(SHARDS)))
    payload = draw(st.binary(max_size=9000))
    cut = draw(st.integers(0, len(payload)))
    chunks = [codec.push_chunks.encode(header, payload[:cut])]
    if cut < len(payload):
        chunks.append(codec.push_chunks.encode(None, payload[cut:]))
    if draw(st.booleans()):
        chunks.append(draw(st.binary(max_size=32)))  # a trailing chunk that is not one
    return chunks


@FUZZ_SETTINGS
@given(chunks=_pushes())
def test_pushes_with_hostile_headers_and_payloads(target, chunks):
    target.answered(lambda: target.client._push(iter(chunks), timeout=20))


@FUZZ_SETTINGS
@given(request=fuzz.registrations())
def test_registrations_near_valid_ones(target, request):
    stub = target.client.channel.unary_unary(
        "/ps.v1.ParameterServer/RegisterModel", request_serializer=lambda m: m.SerializeToString()
    )
    target.answered(lambda: stub(request, timeout=20))


@FUZZ_SETTINGS
@given(push=fuzz.push_headers(SHARDS), split=st.booleans())
def test_pushes_near_valid_ones(target, push, split):
    header, payload = push
    half = len(payload) // 2 if split else len(payload)
    chunks = [codec.push_chunks.encode(header, payload[:half])]
    if half < len(payload):
        chunks.append(codec.push_chunks.encode(None, payload[half:]))
    target.answered(lambda: target.client._push(iter(chunks), timeout=20))


@FUZZ_SETTINGS
@given(method=st.sampled_from(sorted({**UNARY, **STREAMING, "/ps.v1.ParameterServer/Push": None})),
       raw=st.binary(max_size=256))  # fmt: skip
def test_raw_bytes_on_every_method(target, method, raw):
    if method in STREAMING:
        stub = target.client.channel.unary_stream(method)
        target.answered(lambda: list(stub(raw, timeout=3)))
    elif method.endswith("/Push"):
        stub = target.client.channel.stream_unary(method)
        target.answered(lambda: stub(iter([raw]), timeout=20))
    else:
        stub = target.client.channel.unary_unary(method)
        target.answered(lambda: stub(raw, timeout=20))


def _data_port(target: Target) -> int:
    response = target.client.register(sgd_spec(model=fuzz.FUZZ, lr=0.1), 0, timeout=30)
    return response.data_port


@FUZZ_SETTINGS
@given(
    frames=st.lists(
        st.one_of(
            st.binary(max_size=64),
            fuzz.messages(ps_pb2.DataRequest.DESCRIPTOR).map(lambda m: ("message", m)),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_the_data_plane_with_raw_bytes_and_hostile_requests(target, frames):
    """The data plane answers a request with a DataResponse or closes the connection; it
    never dies or hangs (each connection here sends its frames, says it has no more, and
    waits at most 10 s for the daemon's answers and its close)."""

    def converse() -> None:
        with socket.create_connection(("127.0.0.1", _data_port(target)), timeout=10) as sock:
            try:
                _send(sock, frames)
                sock.shutdown(socket.SHUT_WR)  # nothing more comes: a frame cut short ends here
            except OSError:
                return  # the daemon closed the connection on a frame before: its answer to garbage
            try:
                while True:
                    response = recv_message(sock, ps_pb2.DataResponse)
                    assert response.code not in {c.value[0] for c in FORBIDDEN}, response.message
            except (OSError, ValueError, EOFError):
                pass  # closed by the daemon, or nothing more to read before the timeout
            except Exception as exc:  # noqa: BLE001 - a FrameError: the daemon hung up mid-frame
                if type(exc).__name__ != "FrameError":
                    raise

    target.answered(converse)


def _send(sock: socket.socket, frames: list) -> None:
    for frame in frames:
        if isinstance(frame, tuple):
            request = frame[1]
            if request.WhichOneof("kind") == "push" and request.push.model == fuzz.KEPT:
                request.push.model = fuzz.FUZZ
            if request.WhichOneof("kind") == "pull":
                request.pull.min_version = min(request.pull.min_version, 1)  # answered, not waited
                request.timeout_ms = 1000
            send_message(sock, request)
        else:
            sock.sendall(frame)


def test_after_the_fuzzing_the_daemon_serves_and_the_kept_model_is_unchanged(target):
    target.check()
    assert target.calls > 0
    print(f"\nfuzz: {target.calls} requests, {EXAMPLES} examples per property: no crash, no hang, no INTERNAL")
