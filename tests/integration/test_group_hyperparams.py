"""Param groups' settings with each push, through real daemons, on both transports.

A model of odd shapes in three param groups (ParamSpec.group), cut into small shards over two
daemons (cuts fall inside parameters): every GRADIENT push carries each group's lr, weight
decay, betas and eps (AdamW) or momentum and dampening (SGD), changing every step as a
scheduler changes them, and the pulled master (and AdamW's moments) must equal, bit for bit,
torch.optim.AdamW / SGD(param_groups, fused=True) run in process on the same gradients with
the same group settings. With fp16 loss scaling the gradient travels as FP16 times 2**16 and
grad_multiplier 2**-16 brings it back, as GradScaler's unscale_ does (grad.float() times an
fp32 scalar).

Bad groups or multipliers are INVALID_ARGUMENT naming the field over gRPC and the data plane,
and change nothing: the shard's version, master, exp_avg and exp_avg_sq as pulled before, and
the next valid step still matches torch.
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from ps_offload.trainer.wire.sharded_client import ShardedClient
from tests.helpers.group_model import (
    GROUP_OF,
    TorchReference,
    flatten,
    gradients,
    group_model_spec,
    initial_values,
    proto_groups,
    unflatten,
)
from tests.helpers.payloads import byte_view

MOMENTS = (ps_pb2.EXP_AVG, ps_pb2.EXP_AVG_SQ)
LOSS_SCALE = 2.0**16


CASES = [("adamw", ps_pb2.RAW, None), ("sgd", ps_pb2.RAW, None), ("adamw", ps_pb2.FP16, 1 / LOSS_SCALE)]


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_group_settings_each_step_match_torch_fused(daemons, transport):
    """4 KiB shards (1024 elements): 7 shards over 2 daemons, cuts inside p3 and p5."""
    for kind, encoding, multiplier in CASES:
        what = f"{kind} {ps_pb2.Encoding.Name(encoding)} over {transport}"
        name = f"groups-{kind}-{ps_pb2.Encoding.Name(encoding)}-{transport}"
        client = ShardedClient(daemons, config=ClientConfig(transport=transport))
        plan = client.register(group_model_spec(name, kind, shard_bytes=4096))
        assert len(plan) == 7 and {s.daemon_index for s in plan} == {0, 1}
        assert all(isinstance(t, DataPlaneClient) == (transport == "tcp") for t in client.transports)
        initial = initial_values()
        reference = TorchReference(kind, initial)
        flat = flatten(initial)
        for shard in plan:
            client.push(
                shard,
                Push.parameters(client.model, shard.shard_id, byte_view(flat[shard.offset : shard.end]), step=0),
            )
        steps = 4
        for step in range(steps):
            grad = flatten(gradients(step))
            if multiplier is not None:
                sent = (grad * LOSS_SCALE).half()  # the scaled loss's fp16 gradient
                grad = sent.float() * torch.tensor(multiplier, dtype=torch.float32)
                assert torch.isfinite(sent).all() and not torch.equal(grad, sent.float())
            else:
                sent = grad
            reference.step(step, unflatten(grad))
            for shard in plan:
                client.push(
                    shard,
                    Push.gradient(
                        client.model,
                        shard.shard_id,
                        byte_view(sent[shard.offset : shard.end]),
                        step=step,
                        encoding=encoding,
                        groups=proto_groups(kind, step),
                        grad_multiplier=multiplier,
                    ),
                )
        _assert_pulled_equal(client, plan, reference, kind, steps, what)
        client.close()


def _assert_pulled_equal(client, plan: list[ShardSlice], reference: TorchReference, kind: str, version: int, what: str):
    tensors = [(ps_pb2.MASTER, "")] + (
        [(ps_pb2.EXP_AVG, "exp_avg"), (ps_pb2.EXP_AVG_SQ, "exp_avg_sq")] * (kind == "adamw")
    )
    for tensor, state in tensors:
        pulled = torch.empty(sum(s.numel for s in plan))
        for shard in plan:
            out = pulled[shard.offset : shard.end]
            assert client.pull(shard, min_version=version, out=byte_view(out), tensor=tensor) == version
        expected = reference.flat(state)
        assert torch.equal(pulled, expected), (
            f"{what}, {ps_pb2.ShardTensor.Name(tensor)}: max |diff| {(pulled - expected).abs().max().item()}"
        )


# -- bad input ------------------------------------------------------------------------------

SHARD_NUMEL = 2048  # 8 KiB shards: 4 of them, on one daemon
TENSORS = (ps_pb2.MASTER, *MOMENTS)


class GroupModel:
    """An AdamW model in three groups on one daemon, and its torch twin, both at version 1
    (initial values and step 0 with groups)."""

    def __init__(self, address: str, name: str) -> None:
        self.name = name
        self.client = DaemonClient(address, max_message_bytes=8 << 20)
        response = self.client.register(group_model_spec(name, "adamw", shard_bytes=4 * SHARD_NUMEL), 0, timeout=10)
        self.plan = [ShardSlice(s.shard_id, s.daemon_index, s.offset, s.numel) for s in response.shards]
        self.plane = DataPlaneClient("127.0.0.1", response.data_port, max_connections=1)
        initial = initial_values()
        self.reference = TorchReference("adamw", initial)
        for shard in self.plan:
            self._push(self.client, shard, step=0, kind=ps_pb2.PARAMETERS, data=flatten(initial))
        self.step(0)

    def _push(self, transport, shard: ShardSlice, *, data: torch.Tensor, **push) -> ps_pb2.PushResponse:
        piece = byte_view(data[shard.offset : shard.end])
        return transport.push(Push.unchecked(self.name, shard.shard_id, piece, **push), timeout=30)

    def step(self, step: int) -> None:
        grads = gradients(step)
        self.reference.step(step, grads)
        for shard in self.plan:
            ack = self._push(
                self.client,
                shard,
                step=step,
                kind=ps_pb2.GRADIENT,
                data=flatten(grads),
                groups=proto_groups("adamw", step),
            )
            assert ack.applied and ack.version == step + 1

    def shard0(self) -> tuple[list[int], list[torch.Tensor]]:
        versions, tensors = [], []
        for tensor in TENSORS:
            out = torch.empty(SHARD_NUMEL)
            versions.append(
                self.client.pull_into(
                    Pull.of(self.name, 0, min_version=0, tensor=tensor), out=byte_view(out), timeout=10
                )
            )
            tensors.append(out)
        return versions, tensors

    def refuse_on_both_transports(self, field: str, **push) -> None:
        before = self.shard0()
        assert before[0] == [1, 1, 1]
        for transport in (self.client, self.plane):
            with pytest.raises(grpc.RpcError) as info:
                self._push(transport, self.plan[0], **push)
            details = info.value.details()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
            assert field in details and "shard 0" in details, details
            after = self.shard0()
            assert after[0] == before[0]
            assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))

    def matches_reference(self, version: int) -> None:
        for tensor, state in zip(TENSORS, ("", "exp_avg", "exp_avg_sq"), strict=True):
            pulled = torch.empty(self.plan[-1].end)
            for shard in self.plan:
                out = byte_view(pulled[shard.offset : shard.end])
                pull = Pull.of(self.name, shard.shard_id, min_version=version, tensor=tensor)
                assert self.client.pull_into(pull, out=out, timeout=10) == version
            assert torch.equal(pulled, self.reference.flat(state)), ps_pb2.ShardTensor.Name(tensor)

    def close(self) -> None:
        self.plane.close()
        self.client.close()


def _groups_with(index: int, **fields) -> list[ps_pb2.GroupHyperparams]:
    groups = proto_groups("adamw", 1)
    for name, value in fields.items():
        setattr(groups[index], name, value)
    return groups


GRADIENT = flatten(gradients(1))
BAD_PUSHES = {
    "too-few-groups": ("groups has 2 entries, the model has 3", dict(groups=proto_groups("adamw", 1, count=2))),
    "too-many-groups": ("groups has 4 entries", dict(groups=proto_groups("adamw", 1, count=4))),
    "lr-nan": ("groups[1].lr must be finite", dict(groups=_groups_with(1, lr=math.nan))),
    "lr-inf": ("groups[2].lr must be finite", dict(groups=_groups_with(2, lr=math.inf))),
    "lr-negative": ("groups[0].lr must be in [0, 1000]", dict(groups=_groups_with(0, lr=-1e-3))),
    "beta1-one": ("groups[0].beta1 must be in [0, 1)", dict(groups=_groups_with(0, beta1=1.0))),
    "eps-zero": ("groups[2].eps must be finite and > 0", dict(groups=_groups_with(2, eps=0.0))),
    "eps-negative": ("groups[1].eps must be finite and > 0", dict(groups=_groups_with(1, eps=-1e-8))),
    "lr-and-groups": ("lr must be unset when groups are given", dict(lr=1e-3, groups=proto_groups("adamw", 1))),
    "multiplier-zero": ("grad_multiplier must be finite and > 0", dict(grad_multiplier=0.0)),
    "multiplier-nan": ("grad_multiplier must be finite and > 0", dict(grad_multiplier=math.nan)),
    "multiplier-inf": ("grad_multiplier must be finite and > 0", dict(grad_multiplier=math.inf)),
    "groups-on-parameters": (
        "groups is for GRADIENT and APPLY pushes only, this is PARAMETERS",
        dict(kind=ps_pb2.PARAMETERS, groups=proto_groups("adamw", 1)),
    ),
    "multiplier-on-parameters": (
        "grad_multiplier is for GRADIENT and APPLY pushes only",
        dict(kind=ps_pb2.PARAMETERS, groups=(), grad_multiplier=0.5),
    ),
    "groups-on-momentum": (
        "groups is for GRADIENT and APPLY pushes only, this is MOMENTUM",
        dict(kind=ps_pb2.MOMENTUM, variance_frozen_at=1, groups=proto_groups("adamw", 1)),
    ),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_bad_groups_and_multipliers_are_refused_and_change_nothing(daemons, case):
    field, bad = BAD_PUSHES[case]
    model = GroupModel(daemons[0], f"bad-{case}")
    push = dict(step=1, kind=ps_pb2.GRADIENT, data=GRADIENT, groups=proto_groups("adamw", 1)) | bad
    model.refuse_on_both_transports(field, **push)
    model.step(1)
    model.matches_reference(2)
    model.close()


def test_a_gap_in_the_group_numbers_is_refused_at_registration(daemons):
    client = DaemonClient(daemons[0], max_message_bytes=8 << 20)
    gap = tuple(2 if group == 1 else group for group in GROUP_OF)  # groups 0 and 2, no 1
    with pytest.raises(grpc.RpcError) as info:
        client.register(group_model_spec("gap", "adamw", shard_bytes=8192, groups=gap), 0, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ParamSpec.group 1 has none" in info.value.details(), info.value.details()
    assert client.register(group_model_spec("gap", "adamw", shard_bytes=8192), 0, timeout=10).created  # nothing kept
    client.close()
