"""Shards follow blocks, through two real daemons: a spec whose ParamSpec.starts_shard marks
the first parameter of each block (and the first after the last) is registered, the daemons'
plan (RegisterModel's answer, GetModel, ListShards) equals the trainer's, a shard begins at
every flagged parameter so no shard holds two blocks, and one AdamW step pushed and pulled
shard by shard equals torch.optim.AdamW(fused=True) on the whole parameters, bit for bit.
The flag is part of the spec's identity: the same model without it is refused."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from ps_offload.admin import client as admin
from ps_offload.daemon.model.spec import spec_from_dict, spec_to_dict
from ps_offload.daemon.rpc import conversions
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice, plan_shards, shard_numel_for
from ps_offload.proto.push import Push
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.sharded_client import ShardedClient

SHARD_BYTES = 4096  # 1024 elements
# (name, shape, starts_shard). Offsets: embed 0, block0.w 1000, block0.b 2500, block1.w 2513,
# block1.b 4013, head 4026; 4359 elements. Without the flags the cuts would fall at 1024,
# 2048, ..., inside the blocks and across them.
PARAMS = [
    ("embed", (100, 10), False),
    ("block0.w", (30, 50), True),
    ("block0.b", (13,), False),
    ("block1.w", (30, 50), True),
    ("block1.b", (13,), False),
    ("head", (333,), True),
]
TOTAL = sum(math.prod(shape) for _, shape, _ in PARAMS)
FLAGGED_OFFSETS = [1000, 2513, 4026]
BLOCK_OF = {"embed": "embed", "head": "head"} | {name: name.split(".")[0] for name, _, _ in PARAMS[1:5]}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.1


def _spec(name: str, *, flags: bool = True) -> ps_pb2.ModelSpec:
    return ps_pb2.ModelSpec(
        model=name,
        params=[
            ps_pb2.ParamSpec(name=n, shape=list(shape), dtype=ps_pb2.FLOAT32, starts_shard=flag and flags)
            for n, shape, flag in PARAMS
        ],
        optimizer=ps_pb2.OptimizerSpec(
            adamw=ps_pb2.AdamWSpec(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
        ),
        shard_bytes=SHARD_BYTES,
    )


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


def test_the_flag_survives_the_wire_and_the_json():
    spec = conversions.spec_from_proto(_spec("m"))
    assert [p.starts_shard for p in spec.params] == [flag for _, _, flag in PARAMS]
    assert conversions.spec_from_proto(conversions.spec_to_proto(spec)) == spec
    assert spec_from_dict(spec_to_dict(spec)) == spec
    written_before_the_flag = spec_to_dict(spec)
    for param in written_before_the_flag["params"]:
        del param["starts_shard"]
    assert not any(p.starts_shard for p in spec_from_dict(written_before_the_flag).params)


def test_daemons_cut_at_the_flagged_parameters_and_step_like_torch(daemons):
    client = ShardedClient(daemons, config=ClientConfig())
    try:
        plan = client.register(_spec("blocks"))  # raises if a daemon's plan differs from the trainer's
        shard_numel = shard_numel_for(SHARD_BYTES)
        assert plan == plan_shards(TOTAL, shard_numel, len(daemons), FLAGGED_OFFSETS)
        assert [(s.offset, s.numel) for s in plan] == [
            (0, 1000), (1000, 1024), (2024, 489), (2513, 1024), (3537, 489), (4026, 333)
        ]  # fmt: skip
        assert {s.daemon_index for s in plan} == {0, 1}

        # What the admin sees: every daemon's whole plan, and its own shards' parameters, one
        # block per shard.
        for index, address in enumerate(daemons):
            info = admin.get_model(address, "blocks", timeout=10)
            assert [ShardSlice(s.shard_id, s.daemon_index, s.offset, s.numel) for s in info.shards] == plan
            assert [p.starts_shard for p in info.spec.params] == [flag for _, _, flag in PARAMS]
            listed = admin.list_shards(address, "blocks", timeout=10)
            assert sorted(s.shard_id for s in listed) == [s.shard_id for s in plan if s.daemon_index == index]
            for shard in listed:
                assert (shard.offset, shard.numel) == (plan[shard.shard_id].offset, plan[shard.shard_id].numel)
                assert len({BLOCK_OF[name] for name in shard.params}) == 1, f"shard {shard.shard_id}: {shard.params}"

        # One step, shard by shard, against torch.optim on the whole parameters.
        g = torch.Generator().manual_seed(0)
        initial = torch.randn(TOTAL, generator=g)
        gradient = torch.randn(TOTAL, generator=g) * 10.0 ** torch.randint(-3, 2, (TOTAL,), generator=g)
        pulled = torch.empty(TOTAL)
        for shard in plan:
            piece = initial[shard.offset : shard.end].clone()
            assert client.push(shard, Push.parameters(client.model, shard.shard_id, _view(piece), step=0)).version == 0
            out = pulled[shard.offset : shard.end]
            assert client.pull(shard, min_version=0, out=_view(out)) == 0
        assert torch.equal(pulled, initial)
        for shard in plan:
            grad = gradient[shard.offset : shard.end].clone()
            assert client.push(shard, Push.gradient(client.model, shard.shard_id, _view(grad), step=0)).version == 1
            out = pulled[shard.offset : shard.end]
            assert client.pull(shard, min_version=1, out=_view(out)) == 1

        sizes = [math.prod(shape) for _, shape, _ in PARAMS]
        reference = [p.clone().requires_grad_() for p in initial.split(sizes)]
        for r, grad in zip(reference, gradient.split(sizes), strict=True):
            r.grad = grad.clone()
        torch.optim.AdamW(reference, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True).step()
        expected = torch.cat([r.detach() for r in reference])
        assert torch.equal(pulled, expected), f"max |diff| {(pulled - expected).abs().max().item()}"
    finally:
        client.close()


def test_the_same_model_without_the_flags_is_refused(daemons):
    client = ShardedClient(daemons, config=ClientConfig())
    try:
        client.register(_spec("refused"))
        assert client.register(_spec("refused")) and client.created == [False, False]  # idempotent
    finally:
        client.close()
    spec = _spec("refused", flags=False)
    spec.daemons.extend(daemons)
    daemon = DaemonClient(daemons[0], max_message_bytes=8 << 20)
    try:
        with pytest.raises(grpc.RpcError) as info:
            daemon.register(spec, 0, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "parameter 'block0.w' was" in info.value.details()
    finally:
        daemon.close()
