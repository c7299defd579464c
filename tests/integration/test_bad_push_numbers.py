"""Bad numbers in a push or a registration, against a real daemon, one test per field: the
push is refused with INVALID_ARGUMENT naming the field, on the gRPC path and on the TCP data
plane, and nothing changed: the shard's version, its master values and optimizer state
(pulled before and after), and the next valid push gives exactly what it gives on a twin
model that never saw the bad one. With an NVMe tier the same holds across a restart.
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from ps_offload import kernels
from ps_offload.proto import ps_pb2
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from tests.helpers.payloads import byte_view, onebit_payload
from tests.helpers.specs import adamw_spec

N = 2048  # shard 0 of adamw_spec's model (AdamW, lr 0.1)
TENSORS = (ps_pb2.MASTER, ps_pb2.EXP_AVG, ps_pb2.EXP_AVG_SQ)
GRADIENT = torch.linspace(-1, 1, N)
MOMENTUM = torch.linspace(-0.5, 0.25, N)


def _payload(kind: int, encoding: int) -> torch.Tensor:
    values = MOMENTUM if kind == ps_pb2.MOMENTUM else GRADIENT
    if encoding == ps_pb2.ONEBIT:
        return onebit_payload(N)
    if encoding == ps_pb2.BF16:
        return kernels.cast_compress(values, None, torch.bfloat16)
    return values


class Twins:
    """Models 'm' (gets the bad pushes) and 'ref' (does not), both AdamW, initialized to 1.0
    and one RAW gradient step applied to shard 0, so both are at version 1."""

    def __init__(self, address: str) -> None:
        self.client = DaemonClient(address, max_message_bytes=8 << 20)
        for model in ("m", "ref"):
            spec = adamw_spec()
            spec.model = model
            port = self.client.register(spec, 0, timeout=10).data_port
            for shard_id, n in enumerate((N, 952)):
                self.client.push(Push.parameters(model, shard_id, byte_view(torch.ones(n)), step=0), timeout=10)
            ack = self.client.push(Push.gradient(model, 0, byte_view(GRADIENT), step=0), timeout=10)
            assert ack.applied and ack.version == 1
        self.plane = DataPlaneClient("127.0.0.1", port, max_connections=1)

    def state(self, model: str) -> tuple[list[int], list[torch.Tensor]]:
        """Shard 0's versions and tensors (master, exp_avg, exp_avg_sq) as pulled."""
        versions, tensors = [], []
        for tensor in TENSORS:
            out = torch.empty(N)
            versions.append(
                self.client.pull_into(Pull.of(model, 0, min_version=0, tensor=tensor), out=byte_view(out), timeout=10)
            )
            tensors.append(out)
        return versions, tensors

    def refuse_on_both_transports(self, field: str, **push) -> None:
        """The push is INVALID_ARGUMENT naming `field` over gRPC and the data plane, and
        changes nothing on 'm'."""
        before = self.state("m")
        for transport in (self.client, self.plane):
            with pytest.raises(grpc.RpcError) as info:
                transport.push(_build("m", **push), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert field in info.value.details() and "shard 0" in info.value.details(), info.value.details()
            after = self.state("m")
            assert after[0] == before[0] == [1, 1, 1]
            assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))

    def continue_both(self, **push) -> None:
        """A valid push to both twins: the same result, bit for bit."""
        for model in ("m", "ref"):
            ack = self.client.push(_build(model, **push), timeout=30)
            assert ack.applied and ack.version == 2
        (m_versions, m_tensors), (ref_versions, ref_tensors) = self.state("m"), self.state("ref")
        assert m_versions == ref_versions == [2, 2, 2]
        assert all(torch.equal(a, b) for a, b in zip(m_tensors, ref_tensors, strict=True))
        assert all(torch.isfinite(t).all() for t in m_tensors)

    def close(self) -> None:
        self.plane.close()
        self.client.close()


@pytest.fixture
def twins(daemon):
    twins = Twins(daemon.address)
    yield twins
    twins.close()
    assert daemon.process.poll() is None


def _build(model: str, *, data: memoryview, **header) -> Push:
    return Push.unchecked(model, 0, data, **header)


def _push(kind: int, encoding: int, **extra) -> dict:
    frozen = {"variance_frozen_at": 1} if kind == ps_pb2.MOMENTUM else {}
    data = byte_view(_payload(kind, encoding))
    return dict(step=1, kind=kind, encoding=encoding, data=data, **frozen) | extra


LR_CASES = [
    (ps_pb2.GRADIENT, ps_pb2.RAW, math.nan),
    (ps_pb2.GRADIENT, ps_pb2.RAW, math.inf),
    (ps_pb2.GRADIENT, ps_pb2.RAW, -0.1),
    (ps_pb2.GRADIENT, ps_pb2.RAW, 1e300),
    (ps_pb2.GRADIENT, ps_pb2.ONEBIT, 1e4),
    # The MOMENTUM kernels used to change exp_avg and the step count, and scale the master
    # to inf, before failing on lr with INTERNAL, the version unchanged.
    (ps_pb2.MOMENTUM, ps_pb2.RAW, 1e300),
    (ps_pb2.MOMENTUM, ps_pb2.BF16, 1e300),
    (ps_pb2.MOMENTUM, ps_pb2.ONEBIT, 1e300),
    (ps_pb2.MOMENTUM, ps_pb2.RAW, -math.inf),
]


@pytest.mark.parametrize(
    ("kind", "encoding", "lr"),
    LR_CASES,
    ids=[f"{ps_pb2.PushKind.Name(k)}-{ps_pb2.Encoding.Name(e)}-{lr:g}" for k, e, lr in LR_CASES],
)
def test_bad_lr_is_refused_and_changes_nothing(twins, kind, encoding, lr):
    twins.refuse_on_both_transports("lr must be", **_push(kind, encoding, lr=lr))
    twins.continue_both(**_push(kind, encoding, lr=0.05))


@pytest.mark.parametrize("frozen", [0, 2, 2**64 - 1], ids=["zero", "after-the-step", "uint64-max"])
def test_bad_variance_frozen_at_is_refused_and_changes_nothing(twins, frozen):
    bad = _push(ps_pb2.MOMENTUM, ps_pb2.RAW, lr=None, variance_frozen_at=frozen)
    twins.refuse_on_both_transports("variance_frozen_at", **bad)
    twins.continue_both(**_push(ps_pb2.MOMENTUM, ps_pb2.RAW, lr=None))


def test_variance_frozen_at_on_a_gradient_is_refused_and_changes_nothing(twins):
    twins.refuse_on_both_transports(
        "variance_frozen_at", **_push(ps_pb2.GRADIENT, ps_pb2.RAW, lr=None, variance_frozen_at=1)
    )
    twins.continue_both(**_push(ps_pb2.GRADIENT, ps_pb2.RAW, lr=None))


def test_momentum_with_huge_lr_changes_nothing_across_a_restart(daemon_factory, tmp_path):
    nvme = tmp_path / "nvme"
    first = daemon_factory("--nvme-dir", str(nvme))
    twins = Twins(first.address)
    before = twins.state("m")
    twins.refuse_on_both_transports("lr must be", **_push(ps_pb2.MOMENTUM, ps_pb2.RAW, lr=1e300))
    twins.close()
    assert first.stop() == 0
    second = daemon_factory("--nvme-dir", str(nvme))
    twins.client = DaemonClient(second.address, max_message_bytes=8 << 20)
    after = twins.state("m")
    assert after[0] == before[0] == [1, 1, 1]
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))
    twins.continue_both(**_push(ps_pb2.MOMENTUM, ps_pb2.RAW, lr=None))
    twins.client.close()


def _adamw(**fields) -> ps_pb2.OptimizerSpec:
    return ps_pb2.OptimizerSpec(adamw=ps_pb2.AdamWSpec(**({"lr": 0.1, "beta1": 0.9, "beta2": 0.999} | fields)))


def _sgd(**fields) -> ps_pb2.OptimizerSpec:
    return ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(**({"lr": 0.1} | fields)))


BAD_SPECS = {
    "lr-nan": (_adamw(lr=math.nan), "lr must be"),
    "lr-inf": (_sgd(lr=math.inf), "lr must be finite"),
    "lr-huge": (_adamw(lr=1e300), "lr must be in [0, 1000]"),
    "eps-inf": (_adamw(eps=math.inf), "eps must be finite"),
    "weight_decay-inf": (_adamw(weight_decay=math.inf), "weight_decay must be finite"),
    "momentum-nan": (_sgd(momentum=math.nan), "momentum must be"),
    "dampening-inf": (_sgd(dampening=-math.inf), "dampening must be finite"),
    "beta2-nan": (_adamw(beta2=math.nan), "beta2 must be in [0, 1)"),
}


def test_bad_optimizer_numbers_are_refused_at_registration(daemon):
    """One daemon for every field (each start costs seconds on a loaded machine)."""
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    for case, (optimizer, expected) in BAD_SPECS.items():
        spec = adamw_spec()
        spec.optimizer.CopyFrom(optimizer)
        with pytest.raises(grpc.RpcError) as info:
            client.register(spec, 0, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert expected in info.value.details(), (case, info.value.details())
    assert client.register(adamw_spec(), 0, timeout=10).created  # nothing was registered under 'm'
    client.close()


def test_bad_parameter_weight_decay_is_refused_at_registration(daemon):
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    spec = adamw_spec()
    spec.params[0].weight_decay = math.inf
    with pytest.raises(grpc.RpcError) as info:
        client.register(spec, 0, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameter 'w': weight_decay must be finite" in info.value.details()
    client.close()


def _with(values: torch.Tensor, at: int, bad: float) -> torch.Tensor:
    values = values.clone()
    values[at] = bad
    return values


def _topk_with_bad_value(position: int) -> torch.Tensor:
    indices = torch.arange(0, N, 4, dtype=torch.int32)
    values = _with(torch.ones(len(indices)), position, math.nan)
    count = torch.tensor([len(indices)], dtype=torch.int32)
    return torch.cat([count.view(torch.uint8), indices.view(torch.uint8), values.view(torch.uint8)])


def _onebit_with_bad_scale(block: int) -> torch.Tensor:
    payload = onebit_payload(N)
    scales = payload[: 4 * math.ceil(N / 1024)].view(torch.float32)
    scales[block] = math.inf
    return payload


NONFINITE_CASES = {
    "raw-nan": (ps_pb2.GRADIENT, ps_pb2.RAW, _with(GRADIENT, 700, math.nan), "element 700 is nan"),
    "raw-inf": (ps_pb2.GRADIENT, ps_pb2.RAW, _with(GRADIENT, 3, math.inf), "element 3 is inf"),
    "fp16-inf": (ps_pb2.GRADIENT, ps_pb2.FP16, _with(GRADIENT.half(), 9, -math.inf), "element 9 is -inf"),
    "bf16-nan": (ps_pb2.GRADIENT, ps_pb2.BF16, _with(GRADIENT.bfloat16(), 0, math.nan), "element 0 is nan"),
    "topk-nan": (ps_pb2.GRADIENT, ps_pb2.TOPK, _topk_with_bad_value(3), "value 3 (of element 12) is nan"),
    "onebit-scale-inf": (ps_pb2.GRADIENT, ps_pb2.ONEBIT, _onebit_with_bad_scale(1), "block scale 1 is inf"),
    "momentum-raw-inf": (ps_pb2.MOMENTUM, ps_pb2.RAW, _with(MOMENTUM, N - 1, -math.inf), f"element {N - 1} is -inf"),
}


@pytest.mark.parametrize(("kind", "encoding", "payload", "said"), NONFINITE_CASES.values(), ids=NONFINITE_CASES)
def test_a_non_finite_payload_is_refused_naming_the_first_bad_value_and_changes_nothing(
    twins, kind, encoding, payload, said
):
    """It used to be applied, leaving the master non-finite for good for every trainer."""
    bad = _push(kind, encoding) | {"data": byte_view(payload)}
    twins.refuse_on_both_transports(said, **bad)
    twins.continue_both(**_push(kind, ps_pb2.RAW))


def test_with_allow_nonfinite_pushes_a_nan_is_applied_as_torch_would(daemon_factory, tmp_path):
    config = tmp_path / "allow.toml"
    config.write_text("[store]\nallow_nonfinite_pushes = true\n")
    twins = Twins(daemon_factory(config=config).address)
    nan_at_5 = _push(ps_pb2.GRADIENT, ps_pb2.RAW) | {"data": byte_view(_with(GRADIENT, 5, math.nan))}
    ack = twins.client.push(_build("m", **nan_at_5), timeout=10)
    assert ack.applied and ack.version == 2
    versions, (master, *_) = twins.state("m")
    assert versions == [2, 2, 2] and torch.isnan(master[5]) and torch.isfinite(master[:5]).all()
    twins.close()
