"""Bad input, one test each, against a real daemon: a clear status and message, nothing
applied or lost, and the daemon still serving afterwards (checked after every case)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from tests.helpers.payloads import tensor_bytes
from tests.helpers.specs import sgd_spec


@pytest.fixture
def setup(daemon):
    """A registered, initialized model 'm' with values 1.0 and one applied step."""
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    client.register(sgd_spec(), 0, timeout=10)
    for shard_id, n in enumerate((1024, 1024, 952)):
        client.push(Push.parameters("m", shard_id, tensor_bytes(torch.ones(n)), step=0), timeout=10)
    ack = client.push(Push.gradient("m", 0, tensor_bytes(torch.ones(1024)), step=0), timeout=10)
    assert ack.applied and ack.version == 1
    yield daemon, client
    # Still serving, and shard 0 holds exactly what one SGD step gave it: 1 - 0.1 * 1.
    health = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    out = torch.empty(1024)
    assert client.pull_into(Pull.of("m", 0, min_version=1), out=tensor_bytes(out), timeout=10) == 1
    assert torch.equal(out, torch.full((1024,), 1 - 0.1, dtype=torch.float32))
    client.close()
    assert daemon.process.poll() is None


def _status(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_unknown_shard_is_not_found(setup):
    _, client = setup
    code, details = _status(
        lambda: client.pull_into(Pull.of("m", 99, min_version=0), out=tensor_bytes(torch.empty(1)), timeout=5)
    )
    assert code == grpc.StatusCode.NOT_FOUND and "no shard 99" in details
    code, details = _status(
        lambda: client.push(Push.gradient("m", 99, tensor_bytes(torch.ones(1024)), step=1), timeout=5)
    )
    assert code == grpc.StatusCode.NOT_FOUND and "shard 99" in details


def test_unknown_model_is_not_found(setup):
    _, client = setup
    code, details = _status(
        lambda: client.pull_into(Pull.of("nope", 0, min_version=0), out=tensor_bytes(torch.empty(1)), timeout=5)
    )
    assert code == grpc.StatusCode.NOT_FOUND and "'nope' is not registered" in details and "registered: m" in details


def test_wrong_byte_count_is_invalid_argument(setup):
    _, client = setup
    code, details = _status(
        lambda: client.push(Push.gradient("m", 0, tensor_bytes(torch.ones(1000)), step=1), timeout=5)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "4000 bytes" in details and "4096" in details


def test_payload_shorter_than_header_is_invalid_argument(setup):
    _, client = setup
    header = ps_pb2.PushHeader(
        model="m", shard_id=0, step=1, kind=ps_pb2.GRADIENT, encoding=ps_pb2.RAW, dtype=ps_pb2.FLOAT32, nbytes=4096
    )
    chunks = [codec.push_chunks.encode(header, bytes(1000))]
    code, details = _status(lambda: client._push(iter(chunks), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "after 1000 of 4096 bytes" in details


def test_wrong_dtype_is_invalid_argument(setup):
    _, client = setup
    header = ps_pb2.PushHeader(
        model="m", shard_id=0, step=1, kind=ps_pb2.GRADIENT, encoding=ps_pb2.RAW, dtype=ps_pb2.BFLOAT16, nbytes=4096
    )
    code, details = _status(lambda: client._push(iter([codec.push_chunks.encode(header, bytes(4096))]), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bfloat16" in details


def test_missing_header_and_malformed_chunk_are_invalid_argument(setup):
    _, client = setup
    code, details = _status(lambda: client._push(iter([codec.push_chunks.encode(None, bytes(16))]), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "PushHeader" in details
    code, details = _status(lambda: client._push(iter([b"\x0a\xff\xff\xff"]), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in details


def test_push_for_applied_step_is_acknowledged_not_reapplied(setup):
    _, client = setup
    # A retry of step 0 with a different gradient: must not change anything.
    ack = client.push(Push.gradient("m", 0, tensor_bytes(torch.full((1024,), 50.0)), step=0), timeout=5)
    assert not ack.applied and ack.version == 1  # the fixture's teardown checks the values


def test_push_for_future_step_is_failed_precondition(setup):
    _, client = setup
    code, details = _status(
        lambda: client.push(Push.gradient("m", 0, tensor_bytes(torch.ones(1024)), step=5), timeout=5)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "step 5" in details and "version 1" in details


def test_initial_values_after_an_update_are_failed_precondition(setup):
    _, client = setup
    code, details = _status(
        lambda: client.push(Push.parameters("m", 0, tensor_bytes(torch.zeros(1024)), step=0), timeout=5)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "before the first update" in details


def test_conflicting_registration_is_failed_precondition(setup):
    _, client = setup
    assert client.register(sgd_spec(), 0, timeout=5).created is False  # same spec: idempotent
    code, details = _status(lambda: client.register(sgd_spec(shape=(3001,)), 0, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "different spec" in details and "'w'" in details
    code, details = _status(lambda: client.register(sgd_spec(lr=0.5), 0, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "optimizer" in details


def test_invalid_spec_is_invalid_argument(setup):
    _, client = setup
    bad = sgd_spec(model="other")
    bad.shard_bytes = 100
    code, details = _status(lambda: client.register(bad, 0, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "shard_bytes" in details
    code, details = _status(lambda: client.register(sgd_spec(model="other"), 3, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "daemon_index 3" in details


def test_pull_waits_for_version_under_the_deadline(setup):
    _, client = setup
    code, details = _status(
        lambda: client.pull_into(Pull.of("m", 0, min_version=7), out=tensor_bytes(torch.empty(1024)), timeout=1)
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_message_over_limit_is_resource_exhausted(daemon_factory, tmp_path):
    config = tmp_path / "small.toml"
    config.write_text('[server]\nmax_message_bytes = "64KiB"\n')
    daemon = daemon_factory(config=config)
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    client.register(sgd_spec(shape=(100_000,), daemons=("d0",)), 0, timeout=10)
    header = ps_pb2.PushHeader(
        model="m", shard_id=0, step=0, kind=ps_pb2.PARAMETERS, encoding=ps_pb2.RAW, dtype=ps_pb2.FLOAT32, nbytes=4096
    )
    oversized = codec.push_chunks.encode(header, np.zeros(100_000, dtype=np.uint8).tobytes())
    code, details = _status(lambda: client._push(iter([oversized]), timeout=5))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Still serving: a well-formed push works.
    ack = client.push(Push.parameters("m", 0, tensor_bytes(torch.ones(1024)), step=0), timeout=5)
    assert ack.applied
    client.close()


def test_ram_budget_is_resource_exhausted(daemon_factory):
    daemon = daemon_factory("--ram-bytes", "64KiB")
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    code, details = _status(lambda: client.register(sgd_spec(shape=(100_000,)), 0, timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "store.ram_bytes" in details
    client.close()


@pytest.mark.parametrize(
    "name,message",
    [
        ("x" * 201, "takes 201 bytes as a file name, at most 200"),
        ("é" * 40, "takes 240 bytes as a file name, at most 200"),  # 2 UTF-8 bytes each, quoted as 6
        ("a\nb", "contains '\\n': use printable characters only"),
    ],
)
def test_a_model_name_that_cannot_name_its_files_is_invalid_argument_and_leaves_none(
    daemon_factory, tmp_path, name, message
):
    """The model's files on an NVMe daemon are named after it: a name too long for a file name
    (it used to get INTERNAL) or with a control character is refused before any file exists;
    a name just within the bound registers."""
    nvme = tmp_path / "nvme"
    daemon = daemon_factory("--nvme-dir", str(nvme))
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    code, details = _status(lambda: client.register(sgd_spec(model=name), 0, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, details
    assert sorted(p.name for p in nvme.iterdir()) == ["accumulators", "ps-daemon.lock"]
    assert client.register(sgd_spec(model="x" * 200), 0, timeout=10).created
    client.close()


def test_undecodable_requests_are_invalid_argument_naming_the_message_and_logged_once_a_while(setup):
    """Bytes that do not parse as the method's message, on every method that takes a message
    (Push's chunks have their own check): INVALID_ARGUMENT naming the type (gRPC's own answer
    was INTERNAL with an ERROR traceback in the log for each); a client sending them in a loop
    adds a few log lines, not one per request."""
    daemon, client = setup
    methods = {
        "/ps.v1.ParameterServer/RegisterModel": "ps.v1.RegisterModelRequest",
        "/ps.v1.ParameterServer/Prefetch": "ps.v1.PrefetchRequest",
        "/ps.v1.Admin/ListShards": "ps.v1.ListShardsRequest",
        "/ps.v1.Admin/GetShard": "ps.v1.GetShardRequest",
        "/ps.v1.Admin/Stats": "ps.v1.StatsRequest",
        "/ps.v1.Admin/Evict": "ps.v1.GetShardRequest",
        "/ps.v1.Admin/Load": "ps.v1.GetShardRequest",
        "/ps.v1.Admin/ListModels": "ps.v1.ListModelsRequest",
        "/ps.v1.Admin/GetModel": "ps.v1.GetModelRequest",
    }
    streaming = {"/ps.v1.ParameterServer/Pull": "ps.v1.PullRequest", "/ps.v1.Admin/Verify": "ps.v1.VerifyRequest"}
    garbage = b"\xff\xff\xff\xff not a message"
    for method, message in methods.items():
        code, details = _status(lambda m=method: client.channel.unary_unary(m)(garbage, timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"not a valid {message}" in details, (method, details)
    for method, message in streaming.items():
        code, details = _status(lambda m=method: list(client.channel.unary_stream(m)(garbage, timeout=5)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"not a valid {message}" in details, (method, details)
    lines = len(daemon.log().splitlines())
    for _ in range(300):
        _status(lambda: client.channel.unary_unary("/ps.v1.Admin/Stats")(garbage, timeout=5))
    log = daemon.log()
    assert "Traceback" not in log
    assert len(log.splitlines()) - lines <= 2, log.splitlines()[lines:][:5]


def _peak_rss(daemon) -> int:
    for line in open(f"/proc/{daemon.process.pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_registrations_past_a_limit_are_refused_before_any_work_naming_the_limit(daemon_factory, tmp_path):
    """A plan of 2**28 shards (it used to be built under the store's lock, memory climbing
    while every other call waited), a model past the RAM budget (its arenas used to be
    allocated first), and one model more than store.max_models: each RESOURCE_EXHAUSTED at
    once, naming the limit and how to raise it, the daemon's memory untouched, the models
    registered before still served."""
    config = tmp_path / "limits.toml"
    config.write_text('[store]\nmax_models = 2\nram_bytes = "64MiB"\n')
    daemon = daemon_factory(config=config)
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    client.register(sgd_spec(), 0, timeout=10)
    before = _peak_rss(daemon)
    code, details = _status(lambda: client.register(sgd_spec(model="huge", shape=(2**40,)), 0, timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "store.max_shards_per_model = 262144" in details and "larger shards" in details
    big = sgd_spec(model="big", shape=(256 << 20,))  # 1 GiB of master alone, against 64 MiB
    big.shard_bytes = 16 << 20
    code, details = _status(lambda: client.register(big, 0, timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Raise store.ram_bytes" in details, details
    assert _peak_rss(daemon) - before < 256 << 20  # nothing of the 1 GiB (or of the plan) was made
    assert client.register(sgd_spec(model="second"), 0, timeout=10).created
    code, details = _status(lambda: client.register(sgd_spec(model="third"), 0, timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "store.max_models = 2" in details, details
    assert client.register(sgd_spec(), 0, timeout=10).created is False  # a known model is no new one
    client.close()


def _with_lost(push: Push, lost: list[int]) -> Push:
    push.header.lost_holders.extend(lost)
    return push


def test_lost_holders_that_cannot_describe_the_model_are_invalid_argument(setup, daemon_factory):
    """PushHeader.lost_holders (a replicated model's holders its trainer left out): on an
    unreplicated model, outside the daemon list, twice, or naming the daemon it is sent to,
    it is refused and nothing is applied; a fitting list is taken with the push."""
    _, client = setup
    gradient = tensor_bytes(torch.ones(1024))
    code, details = _status(lambda: client.push(_with_lost(Push.gradient("m", 0, gradient, step=1), [1]), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "replicated models only" in details

    replicated = DaemonClient(daemon_factory().address, max_message_bytes=8 << 20)
    spec = sgd_spec(model="r", daemons=("d0", "d1", "d2"))
    spec.replicas = 2
    plan = replicated.register(spec, 0, timeout=10).shards
    held = next(s for s in plan if 0 in s.holders)
    values = tensor_bytes(torch.ones(held.numel))
    replicated.push(Push.parameters("r", held.shard_id, values, step=0), timeout=10)
    for lost, said in (
        ([3], "not indices of the model's 3 daemons"),
        ([1, 1], "twice"),
        ([0], "the one it was sent to"),
    ):
        push = _with_lost(Push.gradient("r", held.shard_id, values, step=0), lost)
        code, details = _status(lambda push=push: replicated.push(push, timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and said in details, details
    other = next(i for i in held.holders if i != 0)
    ack = replicated.push(_with_lost(Push.gradient("r", held.shard_id, values, step=0), [other]), timeout=5)
    assert ack.applied and ack.version == 1  # the refused ones applied nothing
