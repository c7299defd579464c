"""A step's gradient pushed in parts (GRADIENT_PART, then APPLY), through real daemons, over
the TCP data plane (transport "tcp") and gRPC.

The model of tests/helpers/group_model.py, as test_group_hyperparams.py uses it (odd shapes in
three param groups, 4 KiB shards over two daemons, cuts inside parameters): one part and its
APPLY equal, bit for bit, a GRADIENT push of the same bytes (FP16 times 2**16 with
grad_multiplier 2**-16, every group's settings); three BF16 parts equal torch's fused AdamW on
their fp32 sum taken in part order; resent parts and APPLYs, a GRADIENT push over held parts,
and bad input each do what proto/ps.proto says and change nothing else (master, exp_avg,
exp_avg_sq and versions as pulled), after which valid parts still match torch. With an NVMe tier
an APPLY is committed: a daemon killed and started again on the same files has the step, and has
lost the parts of a step not yet applied (APPLY says so; sent again, they apply).
"""

from __future__ import annotations

import signal

import grpc
import pytest
import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.push import Push
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.daemon_client import DaemonError
from ps_offload.trainer.wire.sharded_client import ShardedClient
from tests.helpers.group_model import (
    TorchReference,
    flatten,
    gradients,
    group_model_spec,
    initial_values,
    proto_groups,
    unflatten,
)
from tests.helpers.payloads import byte_view, onebit_payload

TENSORS = ((ps_pb2.MASTER, ""), (ps_pb2.EXP_AVG, "exp_avg"), (ps_pb2.EXP_AVG_SQ, "exp_avg_sq"))
LOSS_SCALE = 2.0**16
NOTHING = memoryview(b"")  # APPLY's payload


class Model:
    """An AdamW model in three param groups, registered through a ShardedClient and holding
    its initial values, and its torch twin (TorchReference: fused AdamW with the same groups)."""

    def __init__(self, daemons: list[str], name: str, transport: str) -> None:
        self.client = ShardedClient(daemons, config=ClientConfig(transport=transport))
        self.plan = self.client.register(group_model_spec(name, "adamw", shard_bytes=4096))
        self.reference = TorchReference("adamw", initial_values())
        flat = flatten(initial_values())
        for shard in self.plan:
            self.client.push(
                shard,
                Push.parameters(
                    self.client.model,
                    shard.shard_id,
                    byte_view(flat[shard.offset : shard.end]),
                    step=0,
                ),
            )

    def parts(self, step: int, sent: list[torch.Tensor], encoding: int, *, first: int = 0) -> None:
        """Pushes parts first.. of `step` to every shard (each a flat tensor of the model)."""
        for shard in self.plan:
            for part, values in enumerate(sent[first:], start=first):
                ack = self.part(shard, step, part, values, encoding)
                assert ack.applied and ack.version == step, (shard.shard_id, part)

    def part(self, shard, step: int, part: int, values: torch.Tensor, encoding: int, **extra) -> ps_pb2.PushResponse:
        piece = byte_view(values[shard.offset : shard.end])
        return self.client.push(
            shard,
            Push.unchecked(
                self.client.model,
                shard.shard_id,
                piece,
                step=step,
                kind=ps_pb2.GRADIENT_PART,
                encoding=encoding,
                part=part,
                **extra,
            ),
        )

    def apply(self, step: int, parts: int, *, applied: bool = True, **settings) -> None:
        settings = dict(groups=proto_groups("adamw", step)) | settings
        for shard in self.plan:
            ack = self.client.push(
                shard,
                Push.unchecked(
                    self.client.model, shard.shard_id, NOTHING, step=step, kind=ps_pb2.APPLY, parts=parts, **settings
                ),
            )
            assert ack.applied == applied and ack.version == step + 1, (shard.shard_id, ack)

    def gradient(self, step: int, sent: torch.Tensor, encoding: int = ps_pb2.RAW, **settings) -> None:
        settings = dict(groups=proto_groups("adamw", step)) | settings
        for shard in self.plan:
            piece = byte_view(sent[shard.offset : shard.end])
            ack = self.client.push(
                shard,
                Push.gradient(
                    self.client.model,
                    shard.shard_id,
                    piece,
                    step=step,
                    encoding=encoding,
                    **settings,
                ),
            )
            assert ack.applied and ack.version == step + 1

    def pulled(self) -> tuple[list[int], list[torch.Tensor]]:
        """Every shard's versions, and master, exp_avg and exp_avg_sq flat, as pulled."""
        versions, tensors = [], []
        for tensor, _ in TENSORS:
            flat = torch.empty(self.plan[-1].end)
            for shard in self.plan:
                out = byte_view(flat[shard.offset : shard.end])
                versions.append(self.client.pull(shard, min_version=0, out=out, tensor=tensor))
            tensors.append(flat)
        return versions, tensors

    def matches_reference(self, version: int, what: str) -> None:
        versions, tensors = self.pulled()
        assert set(versions) == {version}, f"{what}: versions {versions}"
        for (tensor, state), pulled in zip(TENSORS, tensors, strict=True):
            expected = self.reference.flat(state)
            assert torch.equal(pulled, expected), (
                f"{what}, {ps_pb2.ShardTensor.Name(tensor)}: max |diff| {(pulled - expected).abs().max().item()}"
            )

    def close(self) -> None:
        self.client.close()


def _bf16_parts(step: int, count: int = 3) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`count` BF16 parts of `step`'s gradient, and their fp32 sum in part order."""
    sent = [flatten(gradients(10 * step + k)).bfloat16() for k in range(count)]
    total = sent[0].float()
    for part in sent[1:]:
        total = total + part.float()
    return sent, total


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_one_fp16_part_and_its_apply_equal_one_gradient_push(daemons, transport):
    """With every group's settings and fp16 loss scaling's grad_multiplier 2**-16."""
    parts, whole = (Model(daemons, f"one-part-{kind}-{transport}", transport) for kind in ("parts", "whole"))
    assert len(parts.plan) == 7 and {s.daemon_index for s in parts.plan} == {0, 1}
    multiplier = 1 / LOSS_SCALE
    for step in range(3):
        sent = (flatten(gradients(step)) * LOSS_SCALE).half()  # the scaled loss's fp16 gradient
        parts.parts(step, [sent], ps_pb2.FP16)
        parts.apply(step, 1, grad_multiplier=multiplier)
        whole.gradient(step, sent, ps_pb2.FP16, grad_multiplier=multiplier)
        grad = sent.float() * torch.tensor(multiplier, dtype=torch.float32)
        parts.reference.step(step, unflatten(grad))
    ours, theirs = parts.pulled(), whole.pulled()
    assert ours[0] == theirs[0] == [3] * 21
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(a, b), f"max |diff| {(a - b).abs().max().item()}"
    parts.matches_reference(3, f"one FP16 part over {transport}")
    parts.close()
    whole.close()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_three_bf16_parts_equal_fused_adamw_on_their_fp32_sum(daemons, transport):
    model = Model(daemons, f"three-parts-{transport}", transport)
    for step in range(3):
        sent, total = _bf16_parts(step)
        if step == 1:  # the order of the sum shows in these values: a daemon adding otherwise fails
            other = sent[0].float() + (sent[1].float() + sent[2].float())
            assert not torch.equal(total, other)
        model.parts(step, sent, ps_pb2.BF16)
        model.apply(step, 3)
        model.reference.step(step, unflatten(total))
    model.matches_reference(3, f"three BF16 parts over {transport}")
    model.close()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_a_resent_part_or_apply_changes_nothing(daemons, transport):
    model = Model(daemons, f"resent-{transport}", transport)
    sent, total = _bf16_parts(0, count=2)
    other, _ = _bf16_parts(5, count=2)  # other bytes under the same part numbers: must be ignored
    model.parts(0, sent[:1], ps_pb2.BF16)
    for shard in model.plan:
        ack = model.part(shard, 0, 0, other[0], ps_pb2.BF16)  # resent after a lost answer
        assert not ack.applied and ack.version == 0
    model.parts(0, sent, ps_pb2.BF16, first=1)
    for shard in model.plan:
        assert not model.part(shard, 0, 1, other[1], ps_pb2.BF16).applied
    model.apply(0, 2)
    model.reference.step(0, unflatten(total))
    model.matches_reference(1, "after the first APPLY")
    model.apply(0, 2, applied=False)  # resent: the step is applied, version 1
    for shard in model.plan:  # a part of a step applied already
        ack = model.part(shard, 0, 0, other[0], ps_pb2.BF16)
        assert not ack.applied and ack.version == 1
    model.matches_reference(1, "after the resends")
    model.close()


BAD = {
    # name: (the status, words of its message, the push's fields over a valid part 1 of step 1)
    "part-skips-ahead": (grpc.StatusCode.FAILED_PRECONDITION, "expects part 1", dict(part=2)),
    "part-of-a-future-step": (grpc.StatusCode.FAILED_PRECONDITION, "step 1 must be applied first", dict(step=2)),
    "part-with-groups": (
        grpc.StatusCode.INVALID_ARGUMENT,
        "groups is for GRADIENT and APPLY pushes only, this is GRADIENT_PART",
        dict(groups=proto_groups("adamw", 1)),
    ),
    "part-with-lr": (grpc.StatusCode.INVALID_ARGUMENT, "lr is for the APPLY", dict(lr=1e-3)),
    "part-with-multiplier": (
        grpc.StatusCode.INVALID_ARGUMENT,
        "grad_multiplier is for GRADIENT and APPLY",
        dict(grad_multiplier=0.5),
    ),
    "onebit-part": (
        grpc.StatusCode.INVALID_ARGUMENT,
        "a GRADIENT_PART must be RAW, BF16 or FP16",
        dict(encoding=ps_pb2.ONEBIT),
    ),
    "apply-wrong-count": (
        grpc.StatusCode.FAILED_PRECONDITION,
        "names 2 parts, the daemon holds 1 parts",
        dict(kind=ps_pb2.APPLY, part=0, parts=2, data=NOTHING),
    ),
    "apply-with-payload": (
        grpc.StatusCode.INVALID_ARGUMENT,
        "APPLY carries no payload",
        dict(kind=ps_pb2.APPLY, part=0, parts=1),
    ),
    "apply-zero-parts": (
        grpc.StatusCode.INVALID_ARGUMENT,
        "APPLY needs parts >= 1",
        dict(kind=ps_pb2.APPLY, part=0, data=NOTHING),
    ),
    "parts-on-a-part": (grpc.StatusCode.INVALID_ARGUMENT, "parts is for APPLY pushes only", dict(parts=1)),
    "check-only-on-a-part": (
        grpc.StatusCode.INVALID_ARGUMENT,
        "check_only is for APPLY pushes only",
        dict(check_only=True),
    ),
    "check-only-wrong-count": (
        grpc.StatusCode.FAILED_PRECONDITION,
        "names 2 parts, the daemon holds 1 parts",
        dict(kind=ps_pb2.APPLY, part=0, parts=2, data=NOTHING, check_only=True),
    ),
}


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_bad_parts_and_applies_are_refused_and_change_nothing(daemons, transport):
    """Step 0 applied from two parts, part 0 of step 1 held; then each bad push to shard 0,
    then the rest of step 1, which must still give torch's result."""
    model = Model(daemons, f"bad-{transport}", transport)
    sent, total = _bf16_parts(0, count=2)
    model.parts(0, sent, ps_pb2.BF16)
    model.apply(0, 2)
    model.reference.step(0, unflatten(total))
    sent, total = _bf16_parts(1, count=2)
    model.parts(1, sent[:1], ps_pb2.BF16)
    shard = model.plan[0]
    before = model.pulled()
    onebit = onebit_payload(shard.numel)
    for case, (code, words, fields) in BAD.items():
        push = dict(step=1, kind=ps_pb2.GRADIENT_PART, part=1, encoding=ps_pb2.BF16, lr=None) | fields
        data = push.pop(
            "data", byte_view(onebit if push["encoding"] == ps_pb2.ONEBIT else sent[1][shard.offset : shard.end])
        )
        with pytest.raises(DaemonError) as info:
            model.client.push(shard, Push.unchecked(model.client.model, shard.shard_id, data, **push))
        assert info.value.code == code, f"{case}: {info.value}"
        assert words in str(info.value) and "shard 0" in str(info.value), f"{case}: {info.value}"
        after = model.pulled()
        assert after[0] == before[0] == [1] * 21, case
        assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True)), case
    ack = model.part(shard, 0, 0, sent[0], ps_pb2.BF16)  # a part of step 0, applied already
    assert not ack.applied and ack.version == 1
    model.parts(1, sent, ps_pb2.BF16, first=1)
    model.apply(1, 2)
    model.reference.step(1, unflatten(total))
    model.matches_reference(2, f"after bad input over {transport}")
    model.close()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_an_apply_check_applies_nothing(daemons, transport):
    """APPLY check_only answers whether the parts are held (applied=false, version unchanged)
    and changes nothing; the APPLY after it still gives torch's result, and a check of a step
    applied already answers as a resent APPLY does."""
    model = Model(daemons, f"check-{transport}", transport)
    sent, total = _bf16_parts(0, count=2)
    model.parts(0, sent, ps_pb2.BF16)
    before = model.pulled()
    for shard in model.plan:
        ack = model.client.push(
            shard,
            Push.unchecked(
                model.client.model,
                shard.shard_id,
                NOTHING,
                step=0,
                kind=ps_pb2.APPLY,
                parts=2,
                check_only=True,
                groups=proto_groups("adamw", 0),
            ),
        )
        assert not ack.applied and ack.version == 0
    after = model.pulled()
    assert after[0] == before[0] and all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))
    model.apply(0, 2)
    model.reference.step(0, unflatten(total))
    model.matches_reference(1, "after the check and the APPLY")
    ack = model.client.push(
        model.plan[0],
        Push.unchecked(
            model.client.model, model.plan[0].shard_id, NOTHING, step=0, kind=ps_pb2.APPLY, parts=2, check_only=True
        ),
    )
    assert not ack.applied and ack.version == 1
    model.close()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_a_gradient_push_replaces_the_parts_held(daemons, transport):
    model = Model(daemons, f"replaced-{transport}", transport)
    sent, _ = _bf16_parts(0, count=2)
    model.parts(0, sent, ps_pb2.BF16)
    clipped = flatten(gradients(7)) * 0.5  # the whole gradient again, changed after the parts left
    model.gradient(0, clipped)
    model.reference.step(0, unflatten(clipped))
    model.apply(0, 2, applied=False)  # the step is applied; the parts were dropped
    model.matches_reference(1, "after the GRADIENT push")
    sent, total = _bf16_parts(1, count=1)  # the next step starts from nothing
    model.parts(1, sent, ps_pb2.BF16)
    model.apply(1, 1)
    model.reference.step(1, unflatten(total))
    model.matches_reference(2, f"parts after a replaced step over {transport}")
    model.close()


def test_apply_is_committed_on_nvme_and_survives_a_restart(daemon_factory, monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nvme = tmp_path / "nvme"
    first = daemon_factory("--nvme-dir", str(nvme))
    model = Model([first.address], "durable", "tcp")
    sent, total = _bf16_parts(0, count=2)
    model.parts(0, sent, ps_pb2.BF16)
    model.apply(0, 2)
    model.reference.step(0, unflatten(total))
    model.matches_reference(1, "before the restart")
    pending, pending_total = _bf16_parts(1, count=2)
    model.parts(1, pending, ps_pb2.BF16)  # held in RAM only: lost with the process
    model.close()
    first.stop(signal.SIGKILL)

    second = daemon_factory("--nvme-dir", str(nvme))  # new ports, the same files
    assert "recovered" in second.log()
    model.client = ShardedClient([second.address], config=ClientConfig(transport="tcp"))
    assert model.client.register(group_model_spec("durable", "adamw", shard_bytes=4096)) == model.plan
    assert model.client.created == [False]
    model.matches_reference(1, "after the restart")
    model.apply(0, 2, applied=False)  # a retry of the committed APPLY
    with pytest.raises(DaemonError) as info:
        model.client.push(
            model.plan[0],
            Push.unchecked(model.client.model, model.plan[0].shard_id, NOTHING, step=1, kind=ps_pb2.APPLY, parts=2),
        )
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds 0 parts of that step (none:" in str(info.value), str(info.value)
    model.parts(1, pending, ps_pb2.BF16)  # sent again
    model.apply(1, 2)
    model.reference.step(1, unflatten(pending_total))
    model.matches_reference(2, "parts sent again after the restart")
    model.close()
