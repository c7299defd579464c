"""Bad compressed pushes against a real daemon, one case each (as test_bad_input.py does for
RAW): INVALID_ARGUMENT with a message naming the shard and what was expected, nothing
applied, and the daemon still serving (checked after every case)."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_offload.proto import ps_pb2
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from tests.helpers.payloads import byte_view, onebit_payload
from tests.helpers.specs import adamw_spec

SIZES = (2048, 952)  # adamw_spec's plan


def _topk(k_said: int, indices: list[int]) -> torch.Tensor:
    return torch.cat([torch.tensor([k_said], dtype=torch.int32).view(torch.uint8),
                      torch.tensor(indices, dtype=torch.int32).view(torch.uint8),
                      torch.ones(len(indices)).view(torch.uint8)])  # fmt: skip


@pytest.fixture
def setup(daemon):
    """Model 'm' (AdamW), initialized to 1.0, and one fused 1-bit step applied to shard 0."""
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    client.register(adamw_spec(), 0, timeout=10)
    for shard_id, n in enumerate(SIZES):
        client.push(Push.parameters("m", shard_id, byte_view(torch.ones(n)), step=0), timeout=10)
    ack = client.push(
        Push.gradient("m", 0, byte_view(onebit_payload(2048)), step=0, encoding=ps_pb2.ONEBIT), timeout=30
    )
    assert ack.applied and ack.version == 1
    after_one_step = torch.empty(2048)
    client.pull_into(Pull.of("m", 0, min_version=1), out=byte_view(after_one_step), timeout=10)
    assert not torch.equal(after_one_step, torch.ones(2048))
    yield daemon, client
    health = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    out = torch.empty(2048)
    # no step applied since
    assert client.pull_into(Pull.of("m", 0, min_version=1), out=byte_view(out), timeout=10) == 1
    assert torch.equal(out, after_one_step)
    client.close()
    assert daemon.process.poll() is None


def _refused(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


def _push(client, payload: torch.Tensor, encoding: int, *, kind=ps_pb2.GRADIENT, shard_id=0, step=1):
    return lambda: client.push(
        Push.unchecked("m", shard_id, byte_view(payload), step=step, kind=kind, encoding=encoding), timeout=10
    )


@pytest.mark.parametrize(
    ("encoding", "payload", "expected"),
    [
        (
            ps_pb2.ONEBIT,
            onebit_payload(2048)[:-1],
            "header says 263 bytes, the shard needs ONEBIT: 2 float32 scales + 256",
        ),
        (ps_pb2.ONEBIT, torch.ones(2048), "the shard needs ONEBIT"),  # raw fp32 labelled as 1-bit
        (ps_pb2.BF16, torch.ones(1000), "header says 4000 bytes, the shard needs BF16: 2048 2-byte values = 4096"),
        (ps_pb2.FP16, torch.ones(2047, dtype=torch.float16), "FP16: 2048 2-byte values = 4096 bytes"),
        (ps_pb2.TOPK, torch.ones(2, dtype=torch.uint8), "TOPK needs 4 + 8 K bytes"),
        (ps_pb2.TOPK, _topk(2049, list(range(2049))), "1 <= K <= 2048"),
    ],
    ids=["onebit-short", "onebit-raw-size", "bf16-size", "fp16-size", "topk-tiny", "topk-k-over-n"],
)
def test_wrong_size_for_the_encoding_is_invalid_argument(setup, encoding, payload, expected):
    _, client = setup
    details = _refused(_push(client, payload, encoding))
    assert "shard 0" in details and expected in details, details


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (_topk(3, [1, 2]), "TOPK payload says K = 3, but its 20 bytes hold K = 2"),
        (_topk(2, [7, 2048]), "TOPK index 2048 (position 1) is outside the shard's 2048 elements"),
        (
            _topk(3, [1500, 3, 9]),
            "strictly ascending (block-major, ascending within each block); index 3 at position 1",
        ),
        (_topk(2, [4, 4]), "index 4 at position 1 follows 4"),
    ],
    ids=["k-mismatch", "index-out-of-range", "not-ascending", "repeated-index"],
)
def test_bad_topk_content_is_invalid_argument(setup, payload, expected):
    _, client = setup
    details = _refused(_push(client, payload, ps_pb2.TOPK))
    assert "shard 0" in details and expected in details, details


def test_unknown_encoding_is_invalid_argument(setup):
    _, client = setup
    details = _refused(_push(client, torch.ones(2048), 9))
    assert "shard 0" in details and "encoding 9 is unknown" in details and "ONEBIT" in details


def test_compressed_parameters_are_invalid_argument(daemon):
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    client.register(adamw_spec(), 0, timeout=10)
    details = _refused(_push(client, onebit_payload(2048), ps_pb2.ONEBIT, kind=ps_pb2.PARAMETERS, step=0))
    assert "shard 0" in details and "PARAMETERS must be RAW float32" in details and "ONEBIT" in details
    # Nothing was written: the shard still has no values, so a gradient is refused as before.
    with pytest.raises(grpc.RpcError) as info:
        _push(client, onebit_payload(2048), ps_pb2.ONEBIT, step=0)()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    client.close()


def test_compressed_dtype_other_than_float32_is_invalid_argument(setup):
    _, client = setup
    header = ps_pb2.PushHeader(model="m", shard_id=0, step=1, kind=ps_pb2.GRADIENT, encoding=ps_pb2.BF16,
                               dtype=ps_pb2.BFLOAT16, nbytes=4096)  # fmt: skip
    from ps_offload.proto import codec

    details = _refused(lambda: client._push(iter([codec.push_chunks.encode(header, bytes(4096))]), timeout=5))
    assert "dtype bfloat16 is not accepted; send float32" in details


def test_data_plane_refuses_bad_topk_and_keeps_the_connection(setup):
    daemon, client = setup
    port = client.register(adamw_spec(), 0, timeout=10).data_port
    plane = DataPlaneClient("127.0.0.1", port, max_connections=1)
    try:
        push = Push.gradient("m", 0, byte_view(_topk(2, [9, 3])), step=1, encoding=ps_pb2.TOPK)
        details = _refused(lambda: plane.push(push, timeout=10))
        assert "shard 0" in details and "index 3 at position 1 follows 9" in details
        # Same connection, a good 1-bit push to the other shard (shard 0 stays as the fixture left it).
        ack = plane.push(
            Push.gradient("m", 1, byte_view(onebit_payload(952)), step=0, encoding=ps_pb2.ONEBIT), timeout=10
        )
        assert ack.applied and ack.version == 1
    finally:
        plane.close()


def _momentum_push(client, frozen, *, step=1, kind=ps_pb2.MOMENTUM):
    return lambda: client.push(
        Push.unchecked(
            "m",
            0,
            byte_view(onebit_payload(2048)),
            step=step,
            kind=kind,
            encoding=ps_pb2.ONEBIT,
            variance_frozen_at=frozen,
        ),
        timeout=10,
    )


@pytest.mark.parametrize(
    ("frozen", "expected"),
    [(None, r"needs variance_frozen_at in [1, 1] (the uncompressed warm-up steps"), (0, "got 0"), (2, "got 2")],
    ids=["missing", "zero", "after-the-step"],
)
def test_momentum_push_without_a_valid_frozen_step_is_invalid_argument(setup, frozen, expected):
    _, client = setup
    details = _refused(_momentum_push(client, frozen))
    assert "shard 0" in details and "MOMENTUM push for step 1" in details and expected in details, details


def test_frozen_step_on_a_gradient_push_is_invalid_argument(setup):
    _, client = setup
    details = _refused(_momentum_push(client, 1, kind=ps_pb2.GRADIENT))
    assert "variance_frozen_at is for MOMENTUM pushes only, this is GRADIENT" in details


def test_momentum_push_and_state_pulls_to_an_sgd_model_are_failed_precondition(daemon):
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    spec = adamw_spec()
    spec.model = "sgd"
    spec.optimizer.CopyFrom(ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.1, momentum=0.9)))
    client.register(spec, 0, timeout=10)
    client.push(Push.parameters("sgd", 0, byte_view(torch.ones(2048)), step=0), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        client.push(
            Push.unchecked(
                "sgd",
                0,
                byte_view(onebit_payload(2048)),
                step=0,
                kind=ps_pb2.MOMENTUM,
                encoding=ps_pb2.ONEBIT,
                variance_frozen_at=1,
            ),
            timeout=10,
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "need an AdamW model; model 'sgd' runs sgd (push gradients instead)" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.pull_into(
            Pull.of("sgd", 0, min_version=0, tensor=ps_pb2.EXP_AVG_SQ), out=byte_view(torch.empty(2048)), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "runs sgd, which has no exp_avg_sq" in info.value.details()
    # EXP_AVG is SGD's momentum buffer (zeros before the first update).
    momentum = torch.ones(2048)
    client.pull_into(Pull.of("sgd", 0, min_version=0, tensor=ps_pb2.EXP_AVG), out=byte_view(momentum), timeout=10)
    assert torch.equal(momentum, torch.zeros(2048))
    client.close()


@pytest.mark.parametrize("tensor", [3, -1, 1000])
def test_unknown_pull_tensor_is_invalid_argument_on_both_transports(setup, tensor):
    _, client = setup
    out = byte_view(torch.empty(2048))
    details = _refused(lambda: client.pull_into(Pull.of("m", 0, min_version=0, tensor=tensor), out=out, timeout=10))
    assert f"tensor {tensor} is unknown; ask for MASTER, EXP_AVG, EXP_AVG_SQ" in details
    plane = DataPlaneClient("127.0.0.1", client.register(adamw_spec(), 0, timeout=10).data_port, max_connections=1)
    try:
        details = _refused(lambda: plane.pull_into(Pull.of("m", 0, min_version=0, tensor=tensor), out=out, timeout=10))
        assert f"tensor {tensor} is unknown" in details
        assert plane.pull_into(Pull.of("m", 0, min_version=0, tensor=ps_pb2.EXP_AVG), out=out, timeout=10) == 1
    finally:
        plane.close()
