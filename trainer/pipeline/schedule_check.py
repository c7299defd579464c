"""Pipeline schedules as data, checked before anything runs.

A schedule is, per stage, the list of compute actions it runs in order: ("F", 3) is the
forward of micro-batch 3, ("B", 3) its backward, printed `F3` / `B3`. A wrong order does not
fail where it is wrong: it hangs on a receive nobody sends, or quietly holds more activations
than 1F1B promises. So `check_schedule` validates a whole order offline (torch's plan, or what
ranks really ran, as `ScheduleRecorder` saw it) and fails with the grid, the bad cell marked.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from typing import NoReturn

Action = tuple[str, int]
Order = dict[int, list[Action]]
SCHEDULE_NAMES = ("gpipe", "1f1b")


class ScheduleError(ValueError):
    """A pipeline order that breaks a rule; the message holds the whole grid."""


def compute_order(pipeline_order: dict) -> Order:
    """torch's schedule IR (rank -> list of `_Action | None`) as compute actions per stage.

    Idle slots and bookkeeping (REDUCE_GRAD, sends, receives) carry no micro-batch order."""
    order: Order = {}
    for rank, actions in pipeline_order.items():
        order[rank] = []
        for action in actions:
            kind = None if action is None else action.computation_type.value
            if kind in ("F", "B"):
                order[rank].append((kind, action.microbatch_index))
            elif kind in ("I", "W", "OVERLAP_F_B"):
                # Split or fused backwards have rules of their own that this check does not know.
                raise ScheduleError(f"rank {rank} runs {action}: only F and B schedules can be checked")
    return order


def format_grid(order: Order, marked: Collection[tuple[int, int]] = ()) -> str:
    """One row per stage; the cells at (stage, step) in `marked` as >>F3<<; a marked step past
    a row's end (an action that never comes) as >>??<<."""
    width = max([2, *(len(f"{k}{mb}") for row in order.values() for k, mb in row)])
    steps = max([0, *(len(row) for row in order.values()), *(step + 1 for _, step in marked)])

    def cell(text: str, mark: bool) -> str:
        return f">>{text:<{width}}<<" if mark else f"  {text:<{width}}  "

    lines = ["step:    " + "".join(cell(str(step), False) for step in range(steps))]
    for stage in sorted(order):
        cells = [f"{k}{mb}" for k, mb in order[stage]]
        cells += ["??"] * max(0, max((t + 1 for s, t in marked if s == stage), default=0) - len(cells))
        lines.append(f"stage {stage}: " + "".join(cell(c, (stage, t) in marked) for t, c in enumerate(cells)))
    return "\n".join(line.rstrip() for line in lines)


def _fail(order: Order, rule: str, stage: int, step: int, detail: str, marked: set | None = None) -> NoReturn:
    grid = format_grid(order, marked or {(stage, step)})
    raise ScheduleError(f"{rule} (stage {stage}, step {step}): {detail}\n{grid}")


def check_schedule(order: Order, *, stages: int, microbatches: int, schedule: str) -> None:
    """Raises ScheduleError unless `order` runs every micro-batch's forward and backward once
    per stage, each kind in micro-batch order, a backward after its forward, without deadlock
    between neighbouring stages, and in the shape `schedule` ("gpipe" or "1f1b") promises."""
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule must be one of {SCHEDULE_NAMES}, got {schedule!r}")
    if sorted(order) != list(range(stages)):
        _fail(order, "one row per stage", 0, 0, f"rows for stages {sorted(order)}, expected 0..{stages - 1}")
    for stage in range(stages):
        forwarded = backwarded = 0  # the next micro-batch of each kind, as both come in order
        for step, (kind, mb) in enumerate(order[stage]):
            broken = _broken_rule(kind, mb, forwarded, backwarded, stages - stage, microbatches, schedule)
            if broken:
                _fail(order, broken[0], stage, step, f"{kind}{mb}: {broken[1]}")
            forwarded, backwarded = (forwarded + 1, backwarded) if kind == "F" else (forwarded, backwarded + 1)
        end = len(order[stage])
        if forwarded < microbatches:
            _fail(order, "micro-batch missing", stage, end, f"F{forwarded} never runs")
        if backwarded < microbatches:
            _fail(order, "micro-batch missing", stage, end, f"B{backwarded} never runs")
    _check_no_deadlock(order, stages)


def _broken_rule(
    kind: str, mb: int, forwarded: int, backwarded: int, limit: int, microbatches: int, schedule: str
) -> tuple[str, str] | None:
    """(rule, why) for the first rule that `kind`,`mb` breaks after `forwarded` forwards and
    `backwarded` backwards on a stage allowed `limit` micro-batches in flight; None if none."""
    if kind not in ("F", "B") or not isinstance(mb, int):
        return "unknown action", 'actions are ("F" or "B", micro-batch)'
    if not 0 <= mb < microbatches:
        return "micro-batch out of range", f"micro-batches are 0..{microbatches - 1}"
    if kind == "F":
        if mb != forwarded:
            rule = "each forward once" if mb < forwarded else "forwards in micro-batch order"
            return rule, f"F{forwarded} is next"
        # 1F1B's memory bound: stage s holds the activations of at most p - s micro-batches.
        if schedule == "1f1b" and forwarded + 1 - backwarded > limit:
            return "1F1B in-flight limit", f"{forwarded + 1 - backwarded} micro-batches in flight, at most {limit}"
        return None
    if mb >= forwarded:
        return "backward after its forward", f"F{mb} has not run on this stage"
    if mb != backwarded:
        rule = "each backward once" if mb < backwarded else "backwards in micro-batch order"
        return rule, f"B{backwarded} is next"
    if schedule == "gpipe" and forwarded < microbatches:
        return "GPipe: all forwards before any backward", f"F{forwarded} has not run yet"
    return None


def _check_no_deadlock(order: Order, stages: int) -> None:
    # Lockstep, one action per stage per tick: F(s, i) waits for F(s-1, i), B(s, i) for B(s+1, i),
    # finished in an earlier tick. Sends are taken as never blocking, so a deadlock found here is
    # one that no amount of buffering removes.
    finished: set[tuple[str, int, int]] = set()  # (kind, stage, micro-batch)
    next_step = dict.fromkeys(order, 0)
    while any(next_step[stage] < len(order[stage]) for stage in order):
        ready, waiting = [], {}
        for stage, step in next_step.items():
            if step < len(order[stage]):
                kind, mb = order[stage][step]
                neighbour = stage - 1 if kind == "F" else stage + 1
                if 0 <= neighbour < stages and (kind, neighbour, mb) not in finished:
                    waiting[(stage, step)] = (
                        f"stage {stage} step {step} {kind}{mb} waits for {kind}{mb} on stage {neighbour}"
                    )
                else:
                    ready.append((kind, stage, mb))
        if not ready:
            stage, step = min(waiting)
            _fail(order, "deadlock", stage, step, "; ".join(waiting.values()), marked=set(waiting))
        for kind, stage, mb in ready:
            finished.add((kind, stage, mb))
            next_step[stage] += 1


def _planned_order(schedule) -> Order:
    plan = getattr(schedule, "pipeline_order", None)
    if plan is None:
        plan = schedule._get_pipeline_order()
    if plan is None:
        raise ScheduleError(f"{type(schedule).__name__} publishes no pipeline_order to check")
    return compute_order(plan)


def check_torch_schedule(schedule, *, stages: int, microbatches: int, name: str) -> None:
    """Checks the order a torch single-stage schedule (ScheduleGPipe, Schedule1F1B) plans.

    torch 2.13's Schedule1F1B plans its last stage's forwards one micro-batch ahead (F1 B0 F2 ...)
    and fails here, though it runs F0 B0 F1 ...; tests/trainer/pipeline/test_schedule_check.py pins both."""
    check_schedule(_planned_order(schedule), stages=stages, microbatches=microbatches, schedule=name)


def check_planned_schedule(schedule, *, stages: int, microbatches: int, name: str) -> None:
    """Checks the order a torch single-stage schedule will run; PipelineTrainer calls it
    when it is built, so a bad order fails with its grid before the first step hangs.

    Like check_torch_schedule, but the last 1F1B stage is read as torch runs it: torch
    2.13 plans it F1 B0 F2 B1 ... and runs F0 B0 F1 B1 ... (tests/trainer/pipeline/test_schedule_check.py
    pins both). Any other plan, a fixed torch's included, is checked as planned."""
    order = _planned_order(schedule)
    last = stages - 1
    runs = [(kind, mb) for mb in range(microbatches) for kind in "FB"]
    planned_ahead = [(kind, mb + 1 if kind == "F" else mb) for kind, mb in runs]
    if name == "1f1b" and order.get(last) == planned_ahead:
        order[last] = runs
    check_schedule(order, stages=stages, microbatches=microbatches, schedule=name)


class ScheduleRecorder:
    """Records the compute actions a PipelineStage really runs, in order, as ("F"|"B", mb).

    Wraps the stage's `forward_one_chunk` / `backward_one_chunk` on the instance, so only this
    stage is affected; `detach()` (or leaving a `with` block) puts the originals back."""

    def __init__(self, stage) -> None:
        self.stage = stage
        self.actions: list[Action] = []
        self._originals = {}
        for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
            self._originals[method] = stage.__dict__.get(method)  # another wrapper to put back, if any
            setattr(stage, method, self._wrap(getattr(stage, method), kind))

    def _wrap(self, run, kind: str):
        signature = inspect.signature(run)

        def recorded(*args, **kwargs):
            call = signature.bind(*args, **kwargs)
            mb = next(iter(call.arguments.values()))  # fwd_chunk_id / bwd_chunk_id
            split = kind == "B" and not call.arguments.get("full_backward", True)
            result = run(*args, **kwargs)
            self.actions.append(("I" if split else kind, mb))  # after the call: what ran, not what was tried
            return result

        return recorded

    def take(self) -> list[Action]:
        """The actions recorded since the last take (e.g. one schedule step), and forgets them."""
        taken, self.actions = self.actions, []
        return taken

    def detach(self) -> None:
        for method, original in self._originals.items():
            if original is None:
                self.stage.__dict__.pop(method, None)
            else:
                setattr(self.stage, method, original)
        self._originals = {}

    def __enter__(self) -> ScheduleRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()
