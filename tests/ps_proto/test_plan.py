"""Unit tests for ps_proto/plan.py: layouts, shard sizes, plans, plan invariants, segments,
kernel runs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from ps_offload.proto.plan import (
    KERNEL_ALIGN,
    KernelRun,
    ParamLayout,
    PlanError,
    Segment,
    ShardSlice,
    kernel_runs,
    layout_params,
    plan_shards,
    segments_of,
    shard_numel_for,
    validate_kernel_runs,
    validate_plan,
)

# -- layout_params ---------------------------------------------------------------------------


def test_layout_offsets_and_numel():
    layouts = layout_params(
        [
            ("embed", (10, 4), None),
            ("scalar", (), 0.0),
            ("empty", (3, 0), None),
            ("bias", (7,), 0.0),
            ("w", (2, 3, 5), 0.1),
        ]
    )
    assert layouts == [
        ParamLayout(0, "embed", (10, 4), 0, 40, None),
        ParamLayout(1, "scalar", (), 40, 1, 0.0),
        ParamLayout(2, "empty", (3, 0), 41, 0, None),
        ParamLayout(3, "bias", (7,), 41, 7, 0.0),
        ParamLayout(4, "w", (2, 3, 5), 48, 30, 0.1),
    ]


def test_layout_shape_list_becomes_tuple():
    (layout,) = layout_params([("a", [2, 3], None)])
    assert layout.shape == (2, 3)
    assert layout.numel == 6


def test_layout_empty():
    assert layout_params([]) == []


def test_layout_duplicate_name_raises():
    with pytest.raises(PlanError, match="'a'"):
        layout_params([("a", (2,), None), ("b", (3,), None), ("a", (4,), None)])


@pytest.mark.parametrize("shape", [(-1,), (3, -2), (0, -1, 4)])
def test_layout_negative_dim_raises(shape):
    with pytest.raises(PlanError, match="negative"):
        layout_params([("ok", (2,), None), ("bad", shape, None)])


# -- shard_numel_for -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shard_bytes", "numel"),
    [
        (4096, 1024),
        (4097, 1024),
        (8191, 1024),
        (8192, 2048),
        (64 << 20, 16 << 20),
        ((64 << 20) + 4095, 16 << 20),
    ],
)
def test_shard_numel_rounds_down_to_whole_pages(shard_bytes, numel):
    assert shard_numel_for(shard_bytes) == numel
    # Always whole 4 KiB pages of fp32.
    assert (numel * 4) % 4096 == 0


@pytest.mark.parametrize("shard_bytes", [4095, 1, 0, -4096])
def test_shard_numel_refuses_less_than_a_page(shard_bytes):
    with pytest.raises(PlanError, match="4096"):
        shard_numel_for(shard_bytes)


# -- plan_shards -----------------------------------------------------------------------------


def _check_tiling(plan: list[ShardSlice], total: int, shard_numel: int, num_daemons: int) -> None:
    assert len(plan) == math.ceil(total / shard_numel)
    assert [s.shard_id for s in plan] == list(range(len(plan)))
    position = 0
    for s in plan:
        assert s.offset == position
        assert 1 <= s.numel <= shard_numel
        assert 0 <= s.daemon_index < num_daemons
        position = s.end
    assert position == total
    for s in plan[:-1]:
        assert s.numel == shard_numel
    if plan:
        assert plan[-1].numel == total - (len(plan) - 1) * shard_numel


def test_plan_tiles_exactly_with_shorter_last_shard():
    plan = plan_shards(total_numel=25, shard_numel=10, num_daemons=2)
    assert plan == [
        ShardSlice(0, 0, 0, 10),
        ShardSlice(1, 1, 10, 10),
        ShardSlice(2, 0, 20, 5),
    ]
    assert plan[-1].end == 25


def test_plan_exact_multiple_has_no_short_shard():
    plan = plan_shards(total_numel=40, shard_numel=10, num_daemons=3)
    _check_tiling(plan, 40, 10, 3)
    assert [s.numel for s in plan] == [10, 10, 10, 10]


def test_plan_of_nothing_is_empty():
    assert plan_shards(total_numel=0, shard_numel=1024, num_daemons=2) == []


def test_plan_smaller_than_one_shard():
    assert plan_shards(total_numel=7, shard_numel=1024, num_daemons=4) == [ShardSlice(0, 0, 0, 7)]


def test_plan_round_robin_over_equal_shards():
    plan = plan_shards(total_numel=10 * 1024, shard_numel=1024, num_daemons=3)
    assert [s.daemon_index for s in plan] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]


def test_plan_refuses_no_daemons_and_empty_shards():
    with pytest.raises(PlanError, match="empty"):
        plan_shards(total_numel=10, shard_numel=4, num_daemons=0)
    with pytest.raises(PlanError, match="positive"):
        plan_shards(total_numel=10, shard_numel=0, num_daemons=1)


def test_plan_random_cases_tile_and_balance():
    rng = random.Random(20240611)
    for case in range(200):
        shard_numel = rng.randint(1, 4096)
        total = shard_numel * rng.randint(0, 300) + rng.randint(0, shard_numel)
        num_daemons = rng.randint(1, 9)
        plan = plan_shards(total, shard_numel, num_daemons)
        where = f"case {case}: total={total} shard_numel={shard_numel} daemons={num_daemons}"
        _check_tiling(plan, total, shard_numel, num_daemons)
        load = [0] * num_daemons
        for s in plan:
            load[s.daemon_index] += s.numel
        assert sum(load) == total, where
        assert max(load) - min(load) <= shard_numel, f"{where}: unbalanced {load}"
        # Equal shards are dealt round-robin (only the last one can be shorter).
        assert [s.daemon_index for s in plan] == [i % num_daemons for i in range(len(plan))], where
        # The plan passes its own validator.
        validate_plan(plan, total_numel=total, shard_numel=shard_numel, num_daemons=num_daemons)


def test_plan_is_deterministic():
    rng = random.Random(7)
    for _ in range(20):
        args = (rng.randint(0, 100_000), rng.randint(1, 5000), rng.randint(1, 8))
        first, second = plan_shards(*args), plan_shards(*args)
        assert first == second
        assert first is not second


def test_shard_ids_do_not_depend_on_daemon_list():
    slices = {n: [(s.shard_id, s.offset, s.numel) for s in plan_shards(10_000, 777, n)] for n in (1, 2, 5)}
    assert slices[1] == slices[2] == slices[5]


# -- validate_plan ---------------------------------------------------------------------------

# A valid plan by hand: 35 elements, shards of 10, 2 daemons.
TOTAL, SHARD, DAEMONS = 35, 10, 2
GOOD = [
    ShardSlice(0, 0, 0, 10),
    ShardSlice(1, 1, 10, 10),
    ShardSlice(2, 0, 20, 10),
    ShardSlice(3, 1, 30, 5),
]


def _validate(shards, total=TOTAL, shard_numel=SHARD, num_daemons=DAEMONS):
    validate_plan(shards, total_numel=total, shard_numel=shard_numel, num_daemons=num_daemons)


def test_validate_accepts_the_hand_built_plan():
    _validate(GOOD)
    assert GOOD == plan_shards(TOTAL, SHARD, DAEMONS)


def test_validate_accepts_empty_plan_of_nothing():
    _validate([], total=0)


@pytest.mark.parametrize(
    ("shards", "total", "match"),
    [
        pytest.param(
            [ShardSlice(0, 0, 0, 10), ShardSlice(1, 1, 11, 10), ShardSlice(2, 0, 21, 10), ShardSlice(3, 1, 31, 4)],
            TOTAL,
            "starts at 11, expected 10",
            id="gap",
        ),
        pytest.param(
            [ShardSlice(0, 0, 0, 10), ShardSlice(1, 1, 10, 10), ShardSlice(2, 0, 15, 10), ShardSlice(3, 1, 25, 10)],
            TOTAL,
            "starts at 15, expected 20",
            id="overlap",
        ),
        pytest.param(
            [ShardSlice(0, 0, 0, 10), ShardSlice(2, 1, 10, 10), ShardSlice(1, 0, 20, 10), ShardSlice(3, 1, 30, 5)],
            TOTAL,
            "ids must run 0..n-1",
            id="ids-out-of-order",
        ),
        pytest.param(
            [ShardSlice(1, 0, 0, 10), ShardSlice(2, 1, 10, 10), ShardSlice(3, 0, 20, 10), ShardSlice(4, 1, 30, 5)],
            TOTAL,
            "ids must run 0..n-1",
            id="ids-not-from-zero",
        ),
        pytest.param(
            [ShardSlice(0, 0, 0, 10), ShardSlice(1, 1, 10, 10), ShardSlice(2, 0, 20, 10), ShardSlice(3, 1, 30, 11)],
            41,
            "has 11 elements",
            id="oversized-last-shard",
        ),
        pytest.param(
            [ShardSlice(0, 0, 0, 12), ShardSlice(1, 1, 12, 10), ShardSlice(2, 0, 22, 10), ShardSlice(3, 1, 32, 3)],
            TOTAL,
            "has 12 elements",
            id="oversized-middle-shard",
        ),
        pytest.param(
            [ShardSlice(0, 0, 0, 10), ShardSlice(1, 1, 10, 9), ShardSlice(2, 0, 19, 10), ShardSlice(3, 1, 29, 6)],
            TOTAL,
            "has 9 elements",
            id="short-middle-shard",
        ),
        pytest.param(
            [ShardSlice(0, 0, 0, 10), ShardSlice(1, 1, 10, 10), ShardSlice(2, 0, 20, 10), ShardSlice(3, 1, 30, 0)],
            30,
            "has 0 elements",
            id="empty-last-shard",
        ),
        pytest.param(
            [ShardSlice(0, 0, 0, 10), ShardSlice(1, 2, 10, 10), ShardSlice(2, 0, 20, 10), ShardSlice(3, 1, 30, 5)],
            TOTAL,
            r"daemon index 2 not in \[0, 2\)",
            id="daemon-index-too-large",
        ),
        pytest.param(
            [ShardSlice(0, -1, 0, 10), ShardSlice(1, 1, 10, 10), ShardSlice(2, 0, 20, 10), ShardSlice(3, 1, 30, 5)],
            TOTAL,
            r"daemon index -1 not in \[0, 2\)",
            id="daemon-index-negative",
        ),
        pytest.param(
            [ShardSlice(0, 0, 0, 10), ShardSlice(1, 0, 10, 10), ShardSlice(2, 0, 20, 10), ShardSlice(3, 1, 30, 5)],
            TOTAL,
            "unbalanced",
            id="unbalanced",
        ),
        pytest.param(GOOD[:3], TOTAL, "cover 30 elements, the model has 35", id="too-few-shards"),
        pytest.param(GOOD, 45, "cover 35 elements, the model has 45", id="total-larger"),
        pytest.param([], TOTAL, "cover 0 elements", id="empty-plan-for-nonempty-model"),
    ],
)
def test_validate_rejects_broken_plans(shards, total, match):
    with pytest.raises(PlanError, match=match):
        _validate(shards, total=total)


def test_validate_balance_allows_exactly_one_shard_of_difference():
    # Loads [20, 10] differ by one shard: fine. Loads [25, 10] differ by more: refused.
    _validate([ShardSlice(0, 0, 0, 10), ShardSlice(1, 1, 10, 10), ShardSlice(2, 0, 20, 10)], total=30)
    with pytest.raises(PlanError, match="unbalanced"):
        _validate(
            [ShardSlice(0, 0, 0, 10), ShardSlice(1, 1, 10, 10), ShardSlice(2, 0, 20, 10), ShardSlice(3, 0, 30, 5)],
        )


# -- segments_of -----------------------------------------------------------------------------


def test_segments_hand_example():
    layouts = layout_params([("a", (3,), None), ("b", (2, 4), None), ("c", (), None)])  # 3 + 8 + 1 = 12
    plan = plan_shards(12, 5, 2)
    assert [segments_of(s, layouts) for s in plan] == [
        [Segment(0, 0, 0, 3, 3), Segment(1, 3, 0, 2, 8)],
        [Segment(1, 0, 2, 5, 8)],
        [Segment(1, 0, 7, 1, 8), Segment(2, 1, 0, 1, 1)],
    ]


def _check_segments(layouts: list[ParamLayout], shard_numel: int, num_daemons: int) -> None:
    total = sum(layout.numel for layout in layouts)
    flat = np.arange(total, dtype=np.int64)
    # Each parameter's own values, materialised in its own shape, then flattened.
    own = [np.arange(lo.offset, lo.offset + lo.numel, dtype=np.int64).reshape(lo.shape).ravel() for lo in layouts]
    covered: list[list[tuple[int, int]]] = [[] for _ in layouts]
    for shard in plan_shards(total, shard_numel, num_daemons):
        segments = segments_of(shard, layouts)
        # The pieces tile the shard in order, without gaps or overlaps.
        position = 0
        for seg in segments:
            assert seg.shard_start == position
            assert seg.numel > 0
            position += seg.numel
        assert position == shard.numel
        # Parameter indices increase (spec order).
        indices = [seg.param_index for seg in segments]
        assert indices == sorted(set(indices))
        shard_values = flat[shard.offset : shard.end]
        for seg in segments:
            piece = shard_values[seg.shard_start : seg.shard_start + seg.numel]
            expected = own[seg.param_index][seg.param_start : seg.param_start + seg.numel]
            np.testing.assert_array_equal(piece, expected)
            assert seg.param_numel == layouts[seg.param_index].numel
            covered[seg.param_index].append((seg.param_start, seg.numel))
    # Over all shards, every parameter is covered exactly once, in order.
    for layout, pieces in zip(layouts, covered, strict=True):
        position = 0
        for start, numel in pieces:
            assert start == position, layout.name
            position += numel
        assert position == layout.numel, layout.name


def test_segments_cover_shards_and_map_to_parameter_offsets():
    layouts = layout_params(
        [
            ("embed", (50, 30), None),  # spans several shards
            ("ln.weight", (30,), 0.0),
            ("ln.bias", (30,), 0.0),
            ("scalar", (), None),
            ("empty", (0, 5), None),  # no elements: no segment anywhere
            ("w", (7, 11, 3), None),
        ]
    )
    for shard_numel in (1, 7, 64, 1000, 10_000):
        _check_segments(layouts, shard_numel, num_daemons=3)


def test_segments_random_layouts():
    rng = random.Random(1234)
    for case in range(30):
        params = []
        for i in range(rng.randint(1, 12)):
            shape = tuple(rng.choice([0, 1, 2, 3, 5, 17, 64]) for _ in range(rng.randint(0, 3)))
            params.append((f"p{case}_{i}", shape, None))
        _check_segments(layout_params(params), rng.randint(1, 300), rng.randint(1, 5))


def test_segments_skip_empty_parameters():
    layouts = layout_params([("a", (4,), None), ("empty", (0,), None), ("b", (4,), None)])
    (shard,) = plan_shards(8, 8, 1)
    assert segments_of(shard, layouts) == [Segment(0, 0, 0, 4, 4), Segment(2, 4, 0, 4, 4)]


# -- kernel_runs -----------------------------------------------------------------------------


def _in_torch_tail(p: int, n: int, v: int) -> bool:
    """Whether torch's fused kernel computes element p of an n-element tensor in its scalar
    tail, for SIMD width v (the rule ps_proto/plan.py's KERNEL_ALIGN comment states)."""
    return p >= n - n % v


def _check_runs_place_every_element_as_the_whole_parameter(segment: Segment, runs: list[KernelRun]) -> None:
    """The property the invariants exist for, checked element by element for every SIMD
    width that divides KERNEL_ALIGN."""
    for run in runs:
        length = run.context or run.numel
        for j in range(run.numel):
            in_tensor = run.context_start + j
            in_param = segment.param_start + run.shard_start - segment.shard_start + j
            for v in (1, 2, 4, 8, 16, 32, 64):
                assert _in_torch_tail(in_tensor, length, v) == _in_torch_tail(in_param, segment.param_numel, v), (
                    segment,
                    run,
                    j,
                    v,
                )


def test_kernel_runs_hand_examples():
    # A whole parameter, aligned or not in length: one run in place.
    assert kernel_runs(Segment(0, 5, 0, 333, 333)) == [KernelRun(5, 333)]
    # A cut at 919 inside a 4329-element parameter (Linear(13, 333).weight after 105
    # elements, 4 KiB shards): blocks [0, 896) in place, [896, 919) in a 64-element scratch.
    assert kernel_runs(Segment(3, 105, 0, 919, 4329)) == [KernelRun(105, 896), KernelRun(105 + 896, 23, 64, 0)]
    # The rest of it from 919: scratch [919, 960) of block [896, 960), then in place to the end.
    assert kernel_runs(Segment(3, 0, 919, 4329 - 919, 4329)) == [
        KernelRun(0, 41, 64, 23),
        KernelRun(41, 4329 - 960),
    ]
    # Inside one block, touching neither of its ends: one scratch run.
    assert kernel_runs(Segment(0, 7, 70, 10, 4329)) == [KernelRun(7, 10, 64, 6)]
    # Inside the short last block (4329 = 67 * 64 + 41), reaching the end: the scratch is as
    # long as that block, so the scalar tail stays where it is.
    assert kernel_runs(Segment(0, 0, 4300, 29, 4329)) == [KernelRun(0, 29, 41, 12)]
    # From a block start to the parameter's end: in place.
    assert kernel_runs(Segment(0, 0, 4288, 41, 4329)) == [KernelRun(0, 41)]
    # Both ends inside blocks, whole blocks between.
    assert kernel_runs(Segment(1, 3, 10, 200, 1000)) == [
        KernelRun(3, 54, 64, 10),
        KernelRun(57, 128),
        KernelRun(185, 18, 64, 0),
    ]


def test_kernel_runs_random_segments_keep_every_element_in_its_loop():
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.choice([1, 7, 13, 63, 64, 65, 91, 128, 333, 1000, 4329, rng.randint(1, 5000)])
        start = rng.randrange(n)
        numel = rng.randint(1, n - start)
        segment = Segment(0, rng.randint(0, 100), start, numel, n)
        runs = kernel_runs(segment)
        assert len(runs) <= 3
        assert sum(1 for r in runs if r.context) <= 2
        _check_runs_place_every_element_as_the_whole_parameter(segment, runs)


def test_kernel_runs_of_every_plan_segment():
    """Every segment of real plans (odd shapes, odd and page-sized shards) splits validly."""
    layouts = layout_params(
        [("fc1.w", (13, 7), None), ("fc1.b", (13,), 0.0), ("g", (1,), 0.0), ("fc2.w", (333, 13), None),
         ("fc2.b", (333,), 0.0), ("fc3.w", (7, 333), None), ("fc3.b", (7,), 0.0)]
    )  # fmt: skip
    total = sum(lo.numel for lo in layouts)
    for shard_numel in (1, 7, 64, 100, 1000, 1024, 2048, 3072, total):
        for shard in plan_shards(total, shard_numel, 2):
            for segment in segments_of(shard, layouts):
                runs = kernel_runs(segment)
                validate_kernel_runs(segment, runs)
                _check_runs_place_every_element_as_the_whole_parameter(segment, runs)


def test_kernel_runs_with_other_alignments():
    rng = random.Random(3)
    for align in (1, 8, 16):
        for _ in range(300):
            n = rng.randint(1, 300)
            start = rng.randrange(n)
            segment = Segment(0, 0, start, rng.randint(1, n - start), n)
            runs = kernel_runs(segment, align)
            validate_kernel_runs(segment, runs, align)
            if align == 1:
                assert runs == [KernelRun(0, segment.numel)]


_SEG = Segment(0, 10, 10, 200, 1000)  # runs: [10, 64) scratch, [64, 192) in place, [192, 210) scratch


@pytest.mark.parametrize(
    ("runs", "match"),
    [
        ([], "cover 0 elements"),
        ([KernelRun(10, 54, 64, 10), KernelRun(64, 128)], "cover 182"),
        ([KernelRun(11, 54, 64, 10)], "tile the segment"),
        ([KernelRun(10, 0), KernelRun(10, 200)], "tile the segment"),
        ([KernelRun(10, 200)], "starts at parameter element 10"),  # in place from inside a block
        ([KernelRun(10, 54, 64, 9), KernelRun(64, 146)], "starts at parameter element 1, "),  # off its block
        ([KernelRun(10, 54, 64, 10), KernelRun(64, 146)], "ends at parameter element 210"),  # tail moved
        ([KernelRun(10, 54, 64, 10), KernelRun(64, 128), KernelRun(192, 18, 30, 0)], "ends at parameter element 222"),
        ([KernelRun(10, 54, 60, 10), KernelRun(64, 146)], "inside a scratch"),
        ([KernelRun(10, 54, 128, 10), KernelRun(64, 146)], "at most one block"),
        (
            [KernelRun(10, 54, 64, 10), KernelRun(64, 64), KernelRun(128, 64), KernelRun(192, 18, 64, 0)],
            "in-place runs",
        ),
        (
            [KernelRun(10, 54, 64, 10), KernelRun(64, 64, 64, 0), KernelRun(128, 64), KernelRun(192, 18, 64, 0)],
            "only first or last",
        ),
        ([KernelRun(10, 200, 0, 3)], "no context_start"),
    ],
)
def test_validate_kernel_runs_rejects_broken_runs(runs, match):
    with pytest.raises(PlanError, match=match):
        validate_kernel_runs(_SEG, runs)


def test_validate_kernel_runs_rejects_a_segment_outside_its_parameter():
    with pytest.raises(PlanError, match="outside its parameter"):
        validate_kernel_runs(Segment(0, 0, 990, 20, 1000), [KernelRun(0, 20)])


def test_kernel_align_covers_every_simd_width_of_fp32():
    # AVX2: 8 lanes, AVX-512: 16, SVE at most 2048 bits: 64.
    assert KERNEL_ALIGN % 64 == 0
