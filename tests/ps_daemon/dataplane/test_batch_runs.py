"""How a local batch's requests are served (ps_offload.daemon.dataplane.batch_runs): consecutive
pushes to different shards side by side, at most `width` at once, anything else in the batch's
order; the answers always in the batch's order. `answer` here records what it was given; the
daemon's own answer is tests/integration/test_local_batches.py's."""

from __future__ import annotations

import threading
import time

import pytest

from ps_offload.daemon.dataplane.batch_runs import BatchRuns, runs
from ps_offload.proto import ps_pb2


def _push(shard: int, model: str = "m", kind: int = ps_pb2.GRADIENT, **fields) -> ps_pb2.DataRequest:
    return ps_pb2.DataRequest(push=ps_pb2.PushHeader(model=model, shard_id=shard, kind=kind, **fields))


def _pull(shard: int) -> ps_pb2.DataRequest:
    return ps_pb2.DataRequest(pull=ps_pb2.PullRequest(model="m", shard_id=shard))


def _answered(request: ps_pb2.DataRequest) -> ps_pb2.DataResponse:
    """An answer naming its request's shard (in its message), so order can be checked."""
    kind = request.WhichOneof("kind")
    return ps_pb2.DataResponse(message=f"{kind} {getattr(request, kind).shard_id}")


def test_runs_are_consecutive_pushes_to_different_shards_and_anything_else_is_alone():
    batch = [_push(0), _push(1), _push(0, model="other"), _pull(1), _push(2), _push(2), _push(3)]
    assert runs(batch) == [range(0, 3), range(3, 4), range(4, 5), range(5, 7)]
    assert runs([]) == []
    assert runs([_pull(0), _pull(0)]) == [range(0, 1), range(1, 2)]
    # Pushes that commit nothing (a part, an APPLY's check) are served alone, in order.
    part, check = _push(1, kind=ps_pb2.GRADIENT_PART), _push(2, kind=ps_pb2.APPLY, check_only=True)
    assert runs([_push(0), part, check, _push(3, kind=ps_pb2.APPLY)]) == [range(i, i + 1) for i in range(4)]


def test_a_run_of_pushes_is_in_flight_at_once_and_answered_in_order():
    # Each push waits at a barrier for all four: served one after another, the first would
    # wait there alone until the barrier gives up.
    barrier = threading.Barrier(4, timeout=30)

    def answer(request):
        barrier.wait()
        time.sleep(0.01 * (4 - request.push.shard_id))  # the first finishes last
        return _answered(request), True

    served = BatchRuns(4, lambda model: 4)
    try:
        answers, keep = served.serve([_push(i) for i in range(4)], answer)
    finally:
        served.close()
    assert keep and [a.message for a in answers] == [f"push {i}" for i in range(4)]


def test_no_more_pushes_are_in_flight_than_the_model_may_have_and_the_rest_start_as_they_end():
    lock, now, most = threading.Lock(), [0], [0]
    first_three = threading.Barrier(3, timeout=30)  # they start together, or the barrier breaks

    def answer(request):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        if request.push.shard_id < 3:
            first_three.wait()
        time.sleep(0.005)
        with lock:
            now[0] -= 1
        return _answered(request), True

    served = BatchRuns(8, lambda model: 3)
    try:
        answers, keep = served.serve([_push(i) for i in range(10)], answer)
    finally:
        served.close()
    assert keep and [a.message for a in answers] == [f"push {i}" for i in range(10)] and most[0] == 3


def test_a_pull_after_pushes_is_served_once_they_are_all_answered():
    events, lock = [], threading.Lock()

    def answer(request):
        kind = request.WhichOneof("kind")
        with lock:
            events.append(("start", kind, getattr(request, kind).shard_id))
        time.sleep(0.01)
        with lock:
            events.append(("end", kind, getattr(request, kind).shard_id))
        return _answered(request), True

    served = BatchRuns(8, lambda model: 8)
    try:
        answers, _ = served.serve([_push(0), _push(1), _pull(0), _push(0), _push(0)], answer)
    finally:
        served.close()
    assert [a.message for a in answers] == ["push 0", "push 1", "pull 0", "push 0", "push 0"]
    pull_start = events.index(("start", "pull", 0))
    assert {e for e in events[:pull_start]} == {(s, "push", i) for s in ("start", "end") for i in (0, 1)}
    # The two pushes to shard 0 after the pull run one after the other, in order.
    assert events[pull_start + 2 :] == [("start", "push", 0), ("end", "push", 0)] * 2


@pytest.mark.parametrize("width", [1, 4])
def test_an_answer_that_distrusts_the_connection_ends_the_batch_after_its_run(width):
    seen = []

    def answer(request):
        seen.append(request.WhichOneof("kind"))
        return _answered(request), request.WhichOneof("kind") != "push" or request.push.shard_id != 1

    served = BatchRuns(8, lambda model: width)
    try:
        answers, keep = served.serve([_push(0), _push(1), _push(2), _pull(0), _push(3)], answer)
    finally:
        served.close()
    assert not keep and "pull" not in seen
    # One at a time the batch stops at the push that failed; side by side its run is answered.
    assert [a.message for a in answers] == (["push 0", "push 1"] if width == 1 else ["push 0", "push 1", "push 2"])


@pytest.mark.parametrize("most, at_once", [(1, 8), (8, 1)], ids=["without-nvme", "a-tier-smaller-than-the-model"])
def test_one_at_a_time_serves_every_request_on_the_callers_thread_in_order(most, at_once):
    threads, order = set(), []

    def answer(request):
        threads.add(threading.get_ident())
        order.append(request.push.shard_id)
        return _answered(request), True

    served = BatchRuns(most, lambda model: at_once)
    answers, keep = served.serve([_push(i) for i in range(5)], answer)
    served.close()
    assert keep and threads == {threading.get_ident()} and order == list(range(5)) and len(answers) == 5
