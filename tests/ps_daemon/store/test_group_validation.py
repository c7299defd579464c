"""Validation of param groups and grad_multiplier, without a network: ParamSpec.group at
registration, what a PushRequest says on its own, and what it must fit on the shard (the
number of groups, the settings its optimizer reads); a refused push changes nothing."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.errors import FailedPrecondition, InvalidArgument
from ps_offload.daemon.model.spec import MAX_LR, MAX_WEIGHT_DECAY, ModelSpec, ParamSpec, spec_from_dict, spec_to_dict
from ps_offload.daemon.rpc import conversions
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.optimizers import SGD, AdamW, GroupSettings
from ps_offload.proto import ps_pb2

NUMEL = 3072  # 'w' (2000, group 0) and 'b' (1072, group 1) in one 12 KiB shard
ADAMW = GroupSettings(lr=0.01, weight_decay=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
SGD_GROUP = GroupSettings(lr=0.01, weight_decay=0.1, momentum=0.9, dampening=0.0)


def _spec(groups=(0, 1), optimizer=None, name="m") -> ModelSpec:
    sizes = (2000, 1072, 8)[: len(groups)]
    params = tuple(ParamSpec(f"p{i}", (n,), group=g) for i, (n, g) in enumerate(zip(sizes, groups, strict=True)))
    return ModelSpec(name, params, optimizer or AdamW(lr=0.1), NUMEL * 4, ("d",))


# -- registration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ((0, 2), "ParamSpec.group 1 has none (the parameters use groups 0, 2)"),
        ((1, 1), "ParamSpec.group 0 has none"),
        ((0, 4_000_000_000), "ParamSpec.group 1 has none"),  # answered without counting to 4e9
        ((0, -1), "ParamSpec.group must be >= 0"),
    ],
)
def test_a_gap_in_the_group_numbers_is_refused_at_registration(groups, message):
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=NUMEL * 4)
    with pytest.raises(InvalidArgument, match="model 'm': ") as info:
        store.registry.register(_spec(groups), 0)
    assert message in str(info.value)
    assert store.registry.models() == []


def test_groups_are_part_of_the_spec_and_of_its_json():
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=NUMEL * 4)
    assert store.registry.register(_spec((0, 1)), 0)[1]
    assert not store.registry.register(_spec((0, 1)), 0)[1]  # idempotent
    with pytest.raises(FailedPrecondition, match="parameter 'p0' was"):
        store.registry.register(_spec((1, 0)), 0)
    assert store.registry.model("m").shards[0].optimizer.group_count == 2
    spec = _spec((0, 1, 2))
    assert spec_from_dict(spec_to_dict(spec)) == spec and spec.group_count == 3
    written_before_groups = spec_to_dict(spec)
    for param in written_before_groups["params"]:
        del param["group"]
    assert {p.group for p in spec_from_dict(written_before_groups).params} == {0}


def _wire(group: GroupSettings) -> dict:
    """A group's fields as GroupHyperparams takes them (its `extra` is the wire's `settings`)."""
    fields = dataclasses.asdict(group)
    settings = dict(fields.pop("extra"))
    return {**fields, "settings": settings}


def test_the_wire_carries_groups_and_the_multiplier_both_ways():
    spec = _spec((0, 1))
    assert conversions.spec_from_proto(conversions.spec_to_proto(spec)) == spec
    header = ps_pb2.PushHeader(
        model="m", shard_id=0, step=3, kind=ps_pb2.GRADIENT, encoding=ps_pb2.FP16, dtype=ps_pb2.FLOAT32, nbytes=8,
        groups=[ps_pb2.GroupHyperparams(**_wire(ADAMW)), ps_pb2.GroupHyperparams(lr=0.5)],
        grad_multiplier=2.0**-16,
    )  # fmt: skip
    push = conversions.push_request(header)
    assert push.groups == (ADAMW, GroupSettings(lr=0.5, weight_decay=0.0)) and push.grad_multiplier == 2.0**-16
    header.ClearField("grad_multiplier")
    del header.groups[:]
    assert conversions.push_request(header).groups == () and conversions.push_request(header).grad_multiplier is None


# -- a push on its own ----------------------------------------------------------------------


def _bad_group(**fields) -> tuple[GroupSettings, ...]:
    return (ADAMW, dataclasses.replace(ADAMW, **fields))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(kind="parameters", groups=(ADAMW,)), "groups is for GRADIENT and APPLY pushes only, this is PARAMETERS"),
        (dict(kind="momentum", groups=(ADAMW,)), "groups is for GRADIENT and APPLY pushes only, this is MOMENTUM"),
        (dict(kind="parameters", grad_multiplier=1.0), "grad_multiplier is for GRADIENT and APPLY pushes only"),
        (dict(kind="momentum", grad_multiplier=0.5), "grad_multiplier is for GRADIENT and APPLY pushes only"),
        (dict(lr=0.1, groups=(ADAMW,)), "lr must be unset when groups are given"),
        (dict(groups=_bad_group(lr=math.nan)), "groups[1].lr must be finite, got nan"),
        (dict(groups=_bad_group(lr=math.inf)), "groups[1].lr must be finite"),
        (dict(groups=_bad_group(lr=-0.1)), "groups[1].lr must be in [0, 1000]"),
        (dict(groups=_bad_group(lr=MAX_LR * 2)), "groups[1].lr must be in [0, 1000]"),
        (dict(groups=_bad_group(weight_decay=-1.0)), "groups[1].weight_decay must be in [0, 1000]"),
        (dict(groups=_bad_group(weight_decay=math.nan)), "groups[1].weight_decay must be finite"),
        (dict(grad_multiplier=0.0), "grad_multiplier must be finite and > 0"),
        (dict(grad_multiplier=-1.0), "grad_multiplier must be finite and > 0"),
        (dict(grad_multiplier=math.nan), "grad_multiplier must be finite and > 0"),
        (dict(grad_multiplier=math.inf), "grad_multiplier must be finite and > 0"),
        (dict(grad_multiplier=1e300), "grad_multiplier must be finite and > 0 as a float32"),  # inf as fp32
        (dict(grad_multiplier=1e-50), "grad_multiplier must be finite and > 0 as a float32"),  # 0 as fp32
    ],
)
def test_a_push_that_says_something_wrong_about_groups_cannot_be_built(fields, message):
    with pytest.raises(InvalidArgument, match="push to shard 0") as info:
        PushRequest("m", 0, **(dict(step=1, kind="gradient", nbytes=4 * NUMEL) | fields))
    assert message in str(info.value)


def test_the_bounds_themselves_are_accepted():
    edge = GroupSettings(lr=MAX_LR, weight_decay=MAX_WEIGHT_DECAY, beta1=0.0, beta2=0.0, eps=1e-300)
    zero = GroupSettings(lr=0.0, weight_decay=0.0, beta1=math.nextafter(1, 0), beta2=0.5, eps=1.0)
    push = PushRequest("m", 0, step=0, kind="gradient", nbytes=4 * NUMEL, groups=(edge, zero), grad_multiplier=1e-30)
    assert _store(AdamW(lr=0.1)).check_push(push).duplicate is None


# -- a push on its shard: the store refuses it before anything changes ---------------------


def _store(optimizer) -> ShardStore:
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=NUMEL * 4)
    store.registry.register(_spec((0, 1), optimizer), 0)
    store.push(PushRequest("m", 0, step=0, kind="parameters", data=torch.linspace(-1, 1, NUMEL)))
    return store


ADAMW_CASES = [
    ((ADAMW,), "groups has 1 entries, the model has 2 param groups (ParamSpec.group 0..1)"),
    ((ADAMW, ADAMW, ADAMW), "groups has 3 entries, the model has 2"),
    (_bad_group(beta1=1.0), "groups[1].beta1 must be in [0, 1), got 1.0"),
    (_bad_group(beta1=-0.1), "groups[1].beta1 must be in [0, 1)"),
    (_bad_group(beta2=math.nan), "groups[1].beta2 must be in [0, 1), got nan"),
    (_bad_group(eps=0.0), "groups[1].eps must be finite and > 0, got 0.0"),
    (_bad_group(eps=-1e-8), "groups[1].eps must be finite and > 0"),
    (_bad_group(eps=math.inf), "groups[1].eps must be finite and > 0, got inf"),
    (_bad_group(extra=(("d", 1.0),)), "groups[1].settings has 'd', which adamw does not read (it reads none)"),
]
SGD_CASES = [
    (
        (SGD_GROUP, dataclasses.replace(SGD_GROUP, momentum=0.0)),
        "groups[1].momentum must be > 0 (the model was registered",
    ),
    ((SGD_GROUP, dataclasses.replace(SGD_GROUP, momentum=math.nan)), "groups[1].momentum must be finite"),
    ((dataclasses.replace(SGD_GROUP, dampening=-math.inf), SGD_GROUP), "groups[0].dampening must be finite"),
]


@pytest.mark.parametrize(
    ("optimizer", "groups", "message"),
    [(AdamW(lr=0.1), g, m) for g, m in ADAMW_CASES]
    + [(SGD(lr=0.1, momentum=0.5), g, m) for g, m in SGD_CASES]
    + [
        (SGD(lr=0.1), (SGD_GROUP, SGD_GROUP), "groups[0].momentum must be 0 (the model was registered with momentum 0"),
        (
            SGD(lr=0.1, momentum=0.5, nesterov=True),
            (SGD_GROUP, dataclasses.replace(SGD_GROUP, dampening=0.1)),
            "groups[1].dampening must be 0 with nesterov momentum",
        ),
    ],  # fmt: skip
)
def test_groups_that_do_not_fit_the_model_are_refused_and_change_nothing(optimizer, groups, message):
    store = _store(optimizer)
    shard = store.registry.shard("m", 0)
    before = [t.clone() for t in (shard.master, *shard.optimizer.state)]
    announced = PushRequest("m", 0, step=0, kind="gradient", nbytes=4 * NUMEL, groups=groups)
    with pytest.raises(InvalidArgument, match="push to shard 0 of model 'm'") as info:
        store.check_push(announced)  # before the payload is read
    assert message in str(info.value)
    with pytest.raises(InvalidArgument, match="push to shard 0"):
        store.push(announced.with_data(torch.ones(NUMEL)))
    assert shard.version == 0 and shard.optimizer.step.item() == 0
    assert all(torch.equal(a, b) for a, b in zip(before, (shard.master, *shard.optimizer.state), strict=True))
    fitting = (ADAMW, ADAMW) if isinstance(optimizer, AdamW) else (SGD_GROUP, SGD_GROUP)
    if isinstance(optimizer, SGD) and not optimizer.momentum:
        fitting = (dataclasses.replace(SGD_GROUP, momentum=0.0),) * 2
    assert store.push(_push(fitting)).version == 1


def _push(groups) -> PushRequest:
    return PushRequest("m", 0, step=0, kind="gradient", data=torch.ones(NUMEL), groups=groups)
