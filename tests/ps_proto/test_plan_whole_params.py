"""The plan of an optimizer that reads whole parameters (LAMB): no parameter is cut, a
parameter larger than a shard is a shard of its own, starts still begin shards, and the
validator refuses a plan that cuts one."""

from __future__ import annotations

import dataclasses
import random

import pytest

from ps_offload.proto.plan import (
    PlanError,
    layout_params,
    plan_model,
    shard_starts,
    validate_whole_param_plan,
    whole_param_plan,
)


def _layouts(sizes):
    return layout_params([(f"p{i}", (n,), None) for i, n in enumerate(sizes)])


@pytest.mark.parametrize("seed", range(20))
def test_no_parameter_is_cut_and_only_a_lone_parameter_overfills_a_shard(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 7, 300, 1024, 1500, 5000]) for _ in range(rng.randint(1, 30))]
    if not sum(sizes):
        sizes.append(3)
    layouts, shard_numel = _layouts(sizes), 1024
    plan = whole_param_plan(layouts, shard_numel, num_daemons=3)
    assert sum(s.numel for s in plan) == sum(sizes)
    for shard in plan:
        held = [p for p in layouts if p.numel and shard.offset <= p.offset < shard.end]
        assert held and all(p.offset + p.numel <= shard.end for p in held)
        assert shard.numel <= shard_numel or len(held) == 1
    for left, right in zip(plan, plan[1:], strict=False):  # packed: the next parameter did not fit
        assert left.numel + next(p.numel for p in layouts if p.offset == right.offset and p.numel) > shard_numel


def test_starts_begin_shards_and_replicas_are_placed():
    layouts = _layouts([10, 10, 10, 10])
    starts = shard_starts(layouts, [False, False, True, False])
    plan = plan_model(layouts, [False, False, True, False], 4096, 2, 2, whole_params=True)
    assert [s.offset for s in plan] == [0, *starts] == [0, 20]
    assert all(s.replicas for s in plan)


def test_the_validator_refuses_a_cut_parameter():
    layouts = _layouts([600, 600])
    plan = whole_param_plan(layouts, 1024, 1)
    assert [s.numel for s in plan] == [600, 600]
    cut = [dataclasses.replace(plan[0], numel=500), dataclasses.replace(plan[1], offset=500, numel=700)]
    with pytest.raises(PlanError, match="inside a parameter"):
        validate_whole_param_plan(cut, layouts, shard_numel=1024, num_daemons=1)
    merged = [dataclasses.replace(plan[0], numel=1200)]
    with pytest.raises(PlanError, match="several parameters"):
        validate_whole_param_plan(merged, layouts, shard_numel=1024, num_daemons=1)
