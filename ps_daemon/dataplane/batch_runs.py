"""A local batch's pushes served side by side, so that their commits share a group.

Why. A streamed trainer sends a step's APPLYs to a daemon as one batch (and, with
micro_batches=1, a block's GRADIENTs). Served one after another, each push's new version was
made durable before the next push began: every shard its own commit group, two fdatasyncs a
shard (56 commits, 56 groups, 112 flushes a step for a 56-shard model). Served side by side,
each push's optimizer step still runs alone (the fused kernels take one lock) but its commit
queues behind the group being written (ps_offload.daemon.tiers.commit_group), so the step's
shards go to disk in a few groups of many, each with two flushes: the deeper the disk's
flush, the larger the groups.

Which requests. A run is consecutive pushes that commit (not a GRADIENT_PART, which only adds
to a sum in RAM, nor an APPLY's check) to different shards: they commute, so serving them at
once answers what serving them in order would. Any other request, or a second push to a shard
already in the run, ends it and is served after the run is answered, as the batch orders it.

How many at once. Each push side by side holds its shard's arena in the RAM tier until its
group is durable, and the tier's residency window (ps_offload.daemon.store.residency_window)
keeps room for one update in flight. So a run goes side by side only as far as
`updates_at_once` allows: up to the daemon's spare slots per model file (more could not commit
in one group anyway) where the tier holds the model's arenas whole with room to spare, else
one at a time. The next push starts as one is answered. One at a time (and always on a daemon
without NVMe, which has nothing to group) the batch is served in order on the connection's
thread, as before.

Every push of a run is answered, and the connection's thread returns only when all of them
have: the client's memory is read in place (ps_offload.daemon.dataplane.local_server), so no
request may outlive the batch that named it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from ps_offload.proto import ps_pb2

Answer = Callable[[ps_pb2.DataRequest], tuple[ps_pb2.DataResponse, bool]]


# The pushes that commit a new version: a GRADIENT_PART only adds to a sum in RAM, and an
# APPLY's check changes nothing, so side by side they would only contend for the cores.
COMMITTING = frozenset({ps_pb2.GRADIENT, ps_pb2.APPLY, ps_pb2.MOMENTUM, ps_pb2.PARAMETERS, ps_pb2.STATE})


def _commits(request: ps_pb2.DataRequest) -> bool:
    return request.WhichOneof("kind") == "push" and request.push.kind in COMMITTING and not request.push.check_only


def runs(requests: Sequence[ps_pb2.DataRequest]) -> list[range]:
    """`requests`' indices in runs, in order: consecutive pushes that commit, to different
    shards; any other request alone."""
    out: list[range] = []
    start, shards = 0, set()
    for index, request in enumerate(requests):
        key = (request.push.model, request.push.shard_id) if _commits(request) else None
        if key is None or key in shards:
            if index > start:
                out.append(range(start, index))
            start, shards = index, set()
            if key is None:
                out.append(range(index, index + 1))
                start = index + 1
                continue
        shards.add(key)
    if len(requests) > start:
        out.append(range(start, len(requests)))
    return out


class BatchRuns:
    """One connection's server of batches; `close()` when the connection ends."""

    def __init__(self, most: int, at_once: Callable[[str], int] = lambda model: 1) -> None:
        """`most`: pushes side by side at most (the spare slots; 1: in order always);
        `at_once(model)`: how many of a model's may be (ShardStore.updates_at_once)."""
        self.most = max(1, most)
        self.at_once = at_once
        self._pool: ThreadPoolExecutor | None = None  # made at the first run served side by side

    def serve(self, requests: Sequence[ps_pb2.DataRequest], answer: Answer) -> tuple[list[ps_pb2.DataResponse], bool]:
        """Each request's answer, in order, and whether the connection may go on. A request
        answered with "the connection cannot be trusted" (keep False) ends the batch after its
        run: the answers stop there."""
        answers: list[ps_pb2.DataResponse] = []
        for run in runs(requests):
            width = self._width([requests[i] for i in run])
            if width == 1:
                for index in run:
                    response, keep = answer(requests[index])
                    answers.append(response)
                    if not keep:
                        return answers, False
                continue
            results = self._side_by_side([requests[i] for i in run], answer, width)
            answers += [response for response, _ in results]
            if not all(keep for _, keep in results):
                return answers, False
        return answers, True

    def _width(self, run: list[ps_pb2.DataRequest]) -> int:
        if len(run) == 1 or self.most == 1:
            return 1
        return min(self.most, len(run), *(self.at_once(m) for m in {r.push.model for r in run}))

    def _side_by_side(
        self, run: list[ps_pb2.DataRequest], answer: Answer, width: int
    ) -> list[tuple[ps_pb2.DataResponse, bool]]:
        """The run's answers, at most `width` of its pushes in flight, the next starting as one
        is answered."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.most, thread_name_prefix="local-batch-push")
        futures: list[Future] = []
        for request in run:
            running = [f for f in futures if not f.done()]
            if len(running) >= width:
                wait(running, return_when=FIRST_COMPLETED)
            futures.append(self._pool.submit(answer, request))
        return [future.result() for future in futures]  # answer() answers errors: none raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
