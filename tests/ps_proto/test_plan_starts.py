"""Unit tests for the chosen shard starts of ps_proto/plan.py ("shards follow blocks"):
shard_starts, plan_shards with starts, validate_plan with starts. Kept apart from
test_plan.py (plans of equal shards), which is long enough already."""

from __future__ import annotations

import random

import pytest

from ps_offload.proto.plan import PlanError, ShardSlice, layout_params, plan_shards, shard_starts, validate_plan


def _plan_before_starts(total_numel: int, shard_numel: int, num_daemons: int) -> list[ShardSlice]:
    """plan_shards as it was before starts existed, copied: NVMe files written then and the
    trainers that wrote them depend on getting exactly this plan back."""
    load = [0] * num_daemons
    shards = []
    for shard_id, offset in enumerate(range(0, total_numel, shard_numel)):
        numel = min(shard_numel, total_numel - offset)
        daemon = min(range(num_daemons), key=lambda d: (load[d], d))
        load[daemon] += numel
        shards.append(ShardSlice(shard_id, daemon, offset, numel))
    return shards


# -- shard_starts ----------------------------------------------------------------------------


def test_shard_starts_are_the_flagged_parameters_first_elements():
    layouts = layout_params(
        [
            ("embed", (10, 4), None),  # 0..40, flagged: 0 is no cut
            ("block0.w", (8, 3), None),  # 40..64, flagged
            ("block0.b", (3,), None),  # 64..67
            ("empty", (0, 5), None),  # 67..67, flagged: cuts where block1.w begins
            ("block1.w", (8, 3), None),  # 67..91, flagged as well: one cut, not two
            ("head", (9,), None),  # 91..100, flagged
            ("tail", (0,), None),  # 100..100, flagged: the end, nothing to cut
        ]
    )
    flags = [True, True, False, True, True, True, True]
    assert shard_starts(layouts, flags) == [40, 67, 91]
    assert shard_starts(layouts, [False] * len(layouts)) == []
    assert shard_starts([], []) == []


def test_shard_starts_needs_one_flag_per_parameter():
    layouts = layout_params([("a", (4,), None), ("b", (4,), None)])
    with pytest.raises(PlanError, match="1 starts_shard flags for 2 parameters"):
        shard_starts(layouts, [True])


# -- plan_shards with starts -------------------------------------------------------------------


def test_plan_cuts_at_every_start_and_every_shard_numel_after_it():
    # Cuts at 13, 17, 40; between them shards of 10, the piece before a cut shorter.
    plan = plan_shards(total_numel=50, shard_numel=10, num_daemons=2, starts=[13, 17, 40])
    assert plan == [
        ShardSlice(0, 0, 0, 10),  # loads 10, 0
        ShardSlice(1, 1, 10, 3),  # 10, 3
        ShardSlice(2, 1, 13, 4),  # 10, 7
        ShardSlice(3, 1, 17, 10),  # 10, 17
        ShardSlice(4, 0, 27, 10),  # 20, 17
        ShardSlice(5, 1, 37, 3),  # 20, 20
        ShardSlice(6, 0, 40, 10),  # 30, 20 (a tie: the lower index)
    ]


def test_plan_ignores_zero_duplicates_and_order_of_starts():
    expected = plan_shards(50, 10, 2, [13, 17, 40])
    assert plan_shards(50, 10, 2, [40, 0, 13, 17, 13, 40]) == expected
    assert plan_shards(50, 10, 2, (0,)) == plan_shards(50, 10, 2)
    assert plan_shards(0, 10, 2, [0]) == []


@pytest.mark.parametrize("start", [-1, 50, 51])
def test_plan_refuses_starts_outside_the_model(start):
    with pytest.raises(PlanError, match=rf"shard starts \[{start}\] lie outside the model's \(0, 50\)"):
        plan_shards(50, 10, 2, [13, start])


@pytest.mark.parametrize(
    ("total", "shard_numel", "daemons"),
    [(0, 1024, 2), (7, 1024, 4), (25, 10, 2), (40, 10, 3), (10_000, 777, 5), (35, 10, 2), (1, 1, 1)],
)
def test_no_starts_is_the_plan_of_equal_shards_from_before(total, shard_numel, daemons):
    before = _plan_before_starts(total, shard_numel, daemons)
    assert plan_shards(total, shard_numel, daemons) == before
    assert plan_shards(total, shard_numel, daemons, starts=()) == before
    assert plan_shards(total, shard_numel, daemons, starts=[0, 0]) == before


def test_starts_on_shard_boundaries_change_nothing():
    # A start that falls where an equal-shard cut is anyway leaves the plan as it was.
    assert plan_shards(40, 10, 3, [10, 30]) == _plan_before_starts(40, 10, 3)


# -- validate_plan with starts -----------------------------------------------------------------

STARTS = [13]  # 30 elements, shards of 10, 2 daemons, a shard must start at 13
WITH_START = [
    ShardSlice(0, 0, 0, 10),
    ShardSlice(1, 1, 10, 3),
    ShardSlice(2, 1, 13, 10),
    ShardSlice(3, 0, 23, 7),
]


def _validate(shards, starts=STARTS, total=30):
    validate_plan(shards, total_numel=total, shard_numel=10, num_daemons=2, starts=starts)


def test_validate_accepts_the_plan_with_a_start():
    _validate(WITH_START)
    assert plan_shards(30, 10, 2, STARTS) == WITH_START


def test_validate_rejects_a_plan_that_ignores_a_start():
    equal = _plan_before_starts(30, 10, 2)
    with pytest.raises(PlanError, match=r"no shard starts at \[13\], which must begin one"):
        _validate(equal)
    _validate(equal, starts=())  # the same plan is right without the start


def test_validate_rejects_a_short_shard_that_ends_nowhere():
    # The start is honoured, but the shard after it is cut short at 20 for no reason.
    shards = [
        ShardSlice(0, 0, 0, 10),
        ShardSlice(1, 1, 10, 3),
        ShardSlice(2, 1, 13, 7),
        ShardSlice(3, 0, 20, 10),
    ]
    with pytest.raises(PlanError, match="has 7 elements, fewer than 10, but ends at 20, neither a shard start"):
        _validate(shards)


def test_validate_rejects_starts_outside_the_model():
    with pytest.raises(PlanError, match="lie outside"):
        _validate(WITH_START, starts=[13, 30])


# -- random cases ------------------------------------------------------------------------------


def _expected_offsets(total: int, shard_numel: int, cuts: list[int]) -> list[int]:
    """Every cut, then every shard_numel elements after it up to the next cut (independent
    of plan_shards' loop: a set of the offsets, sorted)."""
    offsets = set()
    for begin, stop in zip([0, *cuts], [*cuts, total], strict=True):
        offsets.update(range(begin, stop, shard_numel))
    return sorted(offsets)


def test_random_plans_with_starts_keep_every_invariant():
    rng = random.Random(20250611)
    for case in range(400):
        shard_numel = rng.randint(1, 40)
        total = rng.randint(0, 300)
        num_daemons = rng.randint(1, 5)
        starts = [rng.randrange(total) for _ in range(rng.randint(0, 12))] if total else []
        where = f"case {case}: total={total} shard_numel={shard_numel} daemons={num_daemons} starts={starts}"
        plan = plan_shards(total, shard_numel, num_daemons, starts)
        cuts = sorted(set(starts) - {0})

        assert [s.offset for s in plan] == _expected_offsets(total, shard_numel, cuts), where
        assert [s.shard_id for s in plan] == list(range(len(plan))), where
        assert sum(s.numel for s in plan) == total, where
        for s, following in zip(plan, [*plan[1:], None], strict=True):
            assert 1 <= s.numel <= shard_numel, where
            assert s.end == (following.offset if following else total), where
            if s.numel < shard_numel:
                assert s.end in {*cuts, total}, f"{where}: short shard {s} ends nowhere"
        load = [0] * num_daemons
        for s in plan:
            load[s.daemon_index] += s.numel
        assert max(load) - min(load) <= shard_numel, f"{where}: unbalanced {load}"
        validate_plan(plan, total_numel=total, shard_numel=shard_numel, num_daemons=num_daemons, starts=starts)
        # The plan of equal shards passes with these starts only if it cuts at all of them.
        equal = _plan_before_starts(total, shard_numel, num_daemons)
        if any(c % shard_numel for c in cuts):
            with pytest.raises(PlanError, match="no shard starts at"):
                validate_plan(equal, total_numel=total, shard_numel=shard_numel, num_daemons=num_daemons, starts=starts)
        else:
            assert plan == equal, where
