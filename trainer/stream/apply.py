"""A streamed step's end on the daemons: the parts pushed by its backward passes are checked,
agreed on and applied (trainer/stream/optimizer.py's `step()`).

1. Check: every shard this rank pushes is asked whether it holds all of the step's parts
   (APPLY with check_only: nothing changes). A push that failed, or a shard that lost its
   parts (its daemon restarted), fails the step here, while nothing is applied anywhere.
2. Agree (pipeline stages only): `any_rank(failed)` over the job, so every rank fails the step
   or none does: a step applied by some stages and not others could not be run again.
3. Apply: APPLY on every shard, with the param groups' settings and `multiplier` (a clip
   coefficient, a pipeline's 1 / (dp x micro-batches)). A daemon that lost the parts after the
   check leaves the step applied by some daemons only: StepTorn names them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import grpc

from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.proto.push import Push
from ps_offload.trainer.io.shard_io import first_failure
from ps_offload.trainer.stream.settings import StepLost, StepTorn
from ps_offload.trainer.wire.daemon_client import DaemonError
from ps_offload.trainer.wire.sharded_client import ShardedClient


class PartsApplier:
    def __init__(
        self,
        client: ShardedClient,
        pool: ThreadPoolExecutor,
        shards: list[ShardSlice],
        any_rank: Callable[[bool], bool] | None = None,
    ) -> None:
        """`shards`: the ones this rank pushes and applies."""
        self.client = client
        self.pool = pool
        self.shards = shards
        self.any_rank = any_rank

    def apply(
        self, step: int, groups: list, parts: int, multiplier: float | None, push_failures: list[BaseException]
    ) -> None:
        """Checks, agrees, applies (the module docstring); raises StepLost or StepTorn."""
        what, failures = "a part's push", push_failures
        if not failures:
            what, failures = "the check before APPLY", self._round(step, groups, parts, multiplier, check_only=True)[1]
        failed_elsewhere = self.any_rank(bool(failures)) if self.any_rank is not None else False
        if failures:
            raise self.lost(step, failures, what)
        if failed_elsewhere:
            raise StepLost(
                f"step {step} of {self.client.model!r}: another rank's daemon no longer holds the step's parts; "
                "run the step's micro-batches again on every rank and step again"
            )
        applied, errors = self._round(step, groups, parts, multiplier, check_only=False)
        if errors:
            daemons = sorted({self.client.daemons[s.daemon_index] for s in applied})
            raise StepTorn(
                f"step {step} of {self.client.model!r} was applied by {daemons} but not by every daemon "
                f"({first_failure(errors)}): a daemon lost the step's parts after the check. The model's shards are "
                "now at different versions; restore it from a checkpoint (ps-admin export) or re-register it"
            )

    def _round(
        self, step: int, groups: list, parts: int, multiplier: float | None, *, check_only: bool
    ) -> tuple[list[ShardSlice], list[BaseException]]:
        """APPLY (or its check) on every shard, a daemon's shards in one batch; returns the
        shards that took it, and the failures."""
        batches = [[self.shards[i] for i in group] for group in self.client.batches(self.shards)]
        applies = [self.pool.submit(self._apply, b, step, groups, parts, multiplier, check_only) for b in batches]
        wait(applies)
        answers = []
        for batch, future in zip(batches, applies, strict=True):
            error = future.exception()
            answers += [error] * len(batch) if error is not None else future.result()
        shards = [shard for batch in batches for shard in batch]
        taken = [s for s, a in zip(shards, answers, strict=True) if not isinstance(a, BaseException)]
        return taken, [a for a in answers if isinstance(a, BaseException)]

    def _apply(
        self, shards: list[ShardSlice], step: int, groups: list, parts: int, multiplier: float | None, check_only: bool
    ) -> list[ps_pb2.PushResponse | BaseException]:
        pushes = [
            Push.apply(
                self.client.model,
                shard.shard_id,
                step=step,
                parts=parts,
                groups=groups,
                grad_multiplier=multiplier,
                check_only=check_only,
            )
            for shard in shards
        ]
        return self.client.push_batch(shards, pushes)

    def lost(self, step: int, errors: list[BaseException], what: str) -> BaseException:
        """StepLost when a daemon refused for want of the step's parts; else the error itself."""
        lost = [e for e in errors if isinstance(e, DaemonError) and e.code == grpc.StatusCode.FAILED_PRECONDITION]
        if not lost:
            return first_failure(errors)
        return StepLost(
            f"step {step} of {self.client.model!r}: {what} failed because a daemon no longer holds "
            f"the step's earlier parts ({lost[0]}); run the step's micro-batches again and call step() again"
        )
