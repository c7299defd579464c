"""trainer/pipeline/schedule_check.py: torch's GPipe and 1F1B plans pass, each broken rule fails with the
grid and its cell marked, and the recorder sees what a real stage runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from ps_offload.trainer.pipeline.schedule_check import (
    ScheduleError,
    ScheduleRecorder,
    check_schedule,
    check_torch_schedule,
    compute_order,
)
from ps_offload.trainer.pipeline.trainer import SCHEDULES


def _plan(schedule_class, stages: int, microbatches: int):
    # A real PipelineStage for stage s of p needs p processes. The plan depends on nothing but
    # the stage count and the micro-batch count, and the schedules' own constructors read only
    # `num_stages` from the stage, so a stand-in stage gives torch's real plan for any p offline.
    return schedule_class(SimpleNamespace(num_stages=stages), microbatches, scale_grads=False)


def _order(text: str) -> dict[int, list[tuple[str, int]]]:
    """'F0 F1 B0 B1 | F0 B0 F1 B1' -> one row per stage."""
    return {stage: [(a[0], int(a[1:])) for a in row.split()] for stage, row in enumerate(text.split("|"))}


def _fails(text: str, schedule: str, microbatches: int) -> str:
    order = _order(text)
    with pytest.raises(ScheduleError) as error:
        check_schedule(order, stages=len(order), microbatches=microbatches, schedule=schedule)
    return str(error.value)


def _as_torch_runs_1f1b(order, stages: int):
    # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last stage's forwards from 1
    # (F1 B0 F2 B1 ... Fm B(m-1)), while its _step_microbatches runs F0 B0 F1 B1 ...: the plan is
    # off by one there, not the run (pinned below; the pp x dp run records what really runs).
    last = [(kind, mb - 1 if kind == "F" else mb) for kind, mb in order[stages - 1]]
    return {**order, stages - 1: last}


SIZES = [(1, 1), (1, 3), (2, 2), (2, 4), (3, 5), (4, 4), (4, 9)]


@pytest.mark.parametrize(("stages", "microbatches"), [*SIZES, (4, 2)])
def test_torch_gpipe_plans_pass(stages, microbatches):
    schedule = _plan(ScheduleGPipe, stages, microbatches)
    check_torch_schedule(schedule, stages=stages, microbatches=microbatches, name="gpipe")


@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_torch_1f1b_plans_pass_once_its_last_stage_is_numbered_as_it_runs(stages, microbatches):
    order = _as_torch_runs_1f1b(compute_order(_plan(Schedule1F1B, stages, microbatches).pipeline_order), stages)
    assert order[stages - 1] == [(kind, mb) for mb in range(microbatches) for kind in "FB"]
    check_schedule(order, stages=stages, microbatches=microbatches, schedule="1f1b")


@pytest.mark.parametrize(("stages", "microbatches"), [s for s in SIZES if s[1] > 1])
def test_torch_2_13_plans_the_last_1f1b_stage_one_forward_ahead(stages, microbatches):
    # When this fails, torch has fixed its plan: drop _as_torch_runs_1f1b here and in
    # tests/integration/test_pipeline_dp.py.
    schedule = _plan(Schedule1F1B, stages, microbatches)
    with pytest.raises(ScheduleError, match=rf"forwards in micro-batch order \(stage {stages - 1}, step 0\): F1"):
        check_torch_schedule(schedule, stages=stages, microbatches=microbatches, name="1f1b")


def test_compute_order_keeps_forwards_and_backwards_only():
    F, B, REDUCE = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD, _ComputationType.REDUCE_GRAD
    plan = {0: [None, _Action(0, F, 0), None, _Action(0, B, 0), _Action(0, REDUCE, None)]}
    assert compute_order(plan) == {0: [("F", 0), ("B", 0)]}
    with pytest.raises(ScheduleError, match="only F and B"):
        compute_order({0: [_Action(0, _ComputationType.BACKWARD_WEIGHT, 0)]})
    with pytest.raises(ScheduleError, match="publishes no pipeline_order"):
        check_torch_schedule(SimpleNamespace(pipeline_order=None, _get_pipeline_order=lambda: None),
                             stages=1, microbatches=1, name="gpipe")  # fmt: skip


def test_a_backward_before_its_forward_fails_with_the_grid():
    message = _fails("F0 B1 F1 B0", "1f1b", 2)
    assert message == (
        "backward after its forward (stage 0, step 1): B1: F1 has not run on this stage\n"
        "step:      0     1     2     3\n"
        "stage 0:   F0  >>B1<<  F1    B0"
    )


def test_forwards_out_of_order_and_twice():
    message = _fails("F0 F1 F2 B0 B1 B2 | F0 F2 F1 B0 B1 B2", "gpipe", 3)
    assert message.startswith("forwards in micro-batch order (stage 1, step 1): F2: F1 is next\n")
    assert "stage 0:   F0    F1    F2    B0    B1    B2\nstage 1:   F0  >>F2<<  F1" in message
    assert "each forward once (stage 0, step 1)" in _fails("F0 F0 B0", "gpipe", 1)
    assert "backwards in micro-batch order (stage 0, step 2)" in _fails("F0 F1 B1 B0", "gpipe", 2)


def test_a_missing_micro_batch_is_marked_where_it_should_have_come():
    message = _fails("F0 F1 B0 B1 | F0 B0 F1 B1", "1f1b", 3)
    assert message.startswith("micro-batch missing (stage 0, step 4): F2 never runs\n")
    assert "stage 0:   F0    F1    B0    B1  >>??<<\n" in message
    assert "micro-batch missing (stage 0, step 5): B2 never runs" in _fails("F0 F1 F2 B0 B1", "gpipe", 3)
    assert "micro-batch out of range (stage 0, step 1)" in _fails("F0 F1 B0 B1", "gpipe", 1)


def test_1f1b_refuses_more_micro_batches_in_flight_than_stages_left():
    # Stage 0 of 2 may hold 2: the third forward before a backward is one too many.
    message = _fails("F0 F1 F2 B0 F3 B1 B2 B3 | F0 B0 F1 B1 F2 B2 F3 B3", "1f1b", 4)
    assert message.startswith("1F1B in-flight limit (stage 0, step 2): F2: 3 micro-batches in flight, at most 2\n")
    assert "stage 0:   F0    F1  >>F2<<  B0" in message
    # The last stage may hold only 1, whatever the stages before it do.
    assert "1F1B in-flight limit (stage 1, step 1)" in _fails("F0 F1 B0 B1 | F0 F1 B0 B1", "1f1b", 2)
    # The same orders are fine for GPipe, which makes no such promise.
    check_schedule(_order("F0 F1 F2 B0 B1 B2 | F0 F1 F2 B0 B1 B2"), stages=2, microbatches=3, schedule="gpipe")


def test_gpipe_refuses_a_backward_among_the_forwards():
    one_f_one_b = "F0 F1 B0 F2 B1 B2 | F0 B0 F1 B1 F2 B2"
    check_schedule(_order(one_f_one_b), stages=2, microbatches=3, schedule="1f1b")
    message = _fails(one_f_one_b, "gpipe", 3)
    assert message.startswith("GPipe: all forwards before any backward (stage 0, step 2): B0: F2 has not run yet\n")
    assert "stage 0:   F0    F1  >>B0<<  F2" in message


def test_a_deadlock_between_stages_names_every_stuck_action():
    # Each stage alone is a fine 1F1B order, but stage 0 wants B0 back before it sends F1,
    # and stage 1 sends B0 back only after it has F1.
    message = _fails("F0 B0 F1 B1 F2 B2 | F0 F1 B0 B1 F2 B2 | F0 B0 F1 B1 F2 B2", "1f1b", 3)
    assert message == (
        "deadlock (stage 0, step 1): stage 0 step 1 B0 waits for B0 on stage 1; "
        "stage 1 step 1 F1 waits for F1 on stage 0; stage 2 step 2 F1 waits for F1 on stage 1\n"
        "step:      0     1     2     3     4     5\n"
        "stage 0:   F0  >>B0<<  F1    B1    F2    B2\n"
        "stage 1:   F0  >>F1<<  B0    B1    F2    B2\n"
        "stage 2:   F0    B0  >>F1<<  B1    F2    B2"
    )


def test_rows_must_be_the_stages_and_the_schedule_known():
    with pytest.raises(ScheduleError, match=r"rows for stages \[0\], expected 0..1"):
        check_schedule(_order("F0 B0"), stages=2, microbatches=1, schedule="gpipe")
    with pytest.raises(ValueError, match="schedule must be one of"):
        check_schedule(_order("F0 B0"), stages=1, microbatches=1, schedule="interleaved")


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_recorder_sees_what_a_real_stage_runs_and_lets_go(single_process_group, name):
    stage = PipelineStage(torch.nn.Linear(4, 2), 0, 1, torch.device("cpu"), group=single_process_group)
    schedule = SCHEDULES[name](stage, 3, loss_fn=torch.nn.functional.mse_loss, scale_grads=False)
    recorder = ScheduleRecorder(stage)
    expected = _order({"gpipe": "F0 F1 F2 B0 B1 B2", "1f1b": "F0 B0 F1 B1 F2 B2"}[name])[0]
    for _ in range(2):  # take() splits the record by step
        schedule.step(torch.randn(6, 4), target=torch.randn(6, 2))
        ran = recorder.take()
        assert ran == expected
        check_schedule({0: ran}, stages=1, microbatches=3, schedule=name)
    recorder.detach()
    assert not {"forward_one_chunk", "backward_one_chunk"} & stage.__dict__.keys()
    schedule.step(torch.randn(6, 4), target=torch.randn(6, 2))
    assert recorder.actions == []


def test_a_pipeline_trainer_checks_its_schedule_when_it_is_built(single_process_group, monkeypatch):
    from ps_offload.trainer import AdamW, ParallelConfig, PipelineTrainer
    from ps_offload.trainer.pipeline.grid import RankGrid

    ctx = SimpleNamespace(
        grid=RankGrid(1, 1, 0), pp_group=single_process_group, dp_group=single_process_group, device=torch.device("cpu")
    )
    layers, loss = [torch.nn.Linear(2, 2)], torch.nn.functional.mse_loss
    for name in ("gpipe", "1f1b"):  # torch's own plans pass (1F1B's last stage as it runs)
        config = ParallelConfig(microbatches=3, schedule=name)
        PipelineTrainer(layers, loss, ctx=ctx, optimizer=AdamW(), config=config).close()
    broken = {0: [_Action(0, _ComputationType.FORWARD, 0), _Action(0, _ComputationType.FULL_BACKWARD, 1)]}
    monkeypatch.setattr(ScheduleGPipe, "_get_pipeline_order", lambda self: broken)
    with pytest.raises(ScheduleError, match=r"backward after its forward \(stage 0, step 1\)"):
        PipelineTrainer(
            layers, loss, ctx=ctx, optimizer=AdamW(), config=ParallelConfig(microbatches=2, schedule="gpipe")
        )
