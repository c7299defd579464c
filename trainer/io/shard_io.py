"""A model's shards on the wire: the initial push or the resume, and each step's pushes and pulls.

`ShardIO` is the offload optimizer's (trainer/offload/whole_model.py) I/O half: one task per shard in a
thread pool, in forward order, each pushing the shard's gradient (when this process pushes it)
and then pulling its new version, through the ShardMover (trainer/io/device.py) that gets the
bytes from and to the trainer's device in the compute dtype.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.proto.push import Push
from ps_offload.trainer.io.device import PullTarget, ShardMover, byte_view
from ps_offload.trainer.io.push_compression import PushCompressor
from ps_offload.trainer.wire.sharded_client import ShardedClient
from ps_offload.trainer.wire.transport import PullInto

StepSettings = tuple[list[ps_pb2.GroupHyperparams], "float | None"]
"""What every push of a step carries: each param group's settings and the gradient multiplier."""


class StepAbandoned(RuntimeError):
    """A shard's call not made because another shard of the same step had failed."""


@dataclass(frozen=True)
class _StepTasks:
    """What the shard tasks of one step share."""

    step: int
    settings: StepSettings
    grads: torch.Tensor
    params: torch.Tensor
    after: object  # the device work the host copies follow (ShardMover.mark_compute)
    failed: threading.Event  # set by the first shard whose call failed


class ShardIO:
    def __init__(
        self,
        client: ShardedClient,
        mover: ShardMover,
        *,
        pushes: set[int],
        hints: bool,
        compressor: PushCompressor | None,
    ) -> None:
        """`pushes`: the shards this process pushes (it only pulls the others); `hints`:
        whether it sends the end-of-step prefetch hints (one process per stage does)."""
        self.client = client
        self.plan = client.plan
        self.mover = mover
        self.pushes = pushes
        self.hints = hints
        self.compressor = compressor
        # Payload bytes of this process's gradient pushes that the daemons applied: each
        # (shard, step) once, headers and resent attempts not counted.
        self.bytes_pushed = 0
        self._bytes_lock = threading.Lock()
        workers = max(2, client.config.streams_per_daemon * len(client.daemons))
        if mover.buffers is not None:
            # No more tasks at once than host buffers: a running task never waits for a buffer.
            # Otherwise a pull waiting for a version another replica pushes could hold the
            # buffer this process's own push needs, while that replica's pull does the same.
            workers = min(workers, mover.buffers.count)
        self.workers = workers
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ps-io")

    # -- start-up ------------------------------------------------------------------------

    def attach(self, values: torch.Tensor) -> int:
        """Fresh model: pushes `values` (the initial compute copy). Known model: pulls the
        daemons' values into it (every shard must be at the same version). Returns the step."""
        # Either way the copies follow what the device queued into `values` so far (the flat
        # buffer's fill, trainer/io/flat.py), on this thread's current stream.
        after = self.mover.mark_compute()
        if self.fresh():
            self.run_all(lambda s: self._push_initial(values, s, after))
            return 0
        versions = self.run_all(lambda s: self.pull(s, 0, values, after, None))
        if len(set(versions)) != 1:
            raise RuntimeError(f"shards are at different versions {sorted(set(versions))}; cannot resume")
        momentum = self.compressor.momentum if self.compressor else None
        if momentum is not None:  # 1-bit Adam goes on from the daemons' exp_avg
            host = torch.zeros_like(momentum, device="cpu")
            into = byte_view(host)
            self.run_all(
                lambda s: (
                    self.client.pull(s, min_version=0, out=into[s.offset * 4 : s.end * 4], tensor=ps_pb2.EXP_AVG)
                    if s.shard_id in self.pushes
                    else None
                )
            )
            momentum.copy_(host)
        return versions[0]

    def fresh(self) -> bool:
        """Whether the registration created the model on every daemon (True) or found it on
        every daemon (False); raises when only some daemons knew it."""
        created = self.client.created
        if any(created) and not all(created) and self.client.spec.replicas > 1:
            self.client.adopt_fresh_holders([i for i, c in enumerate(created) if c])
            return False
        if any(created) and not all(created):
            fresh = [self.client.daemons[i] for i, c in enumerate(created) if c]
            raise RuntimeError(
                f"daemons {fresh} did not know model {self.client.model!r} while the others did: "
                "their state was lost (restarted without persistence?). Re-register under a new name."
            )
        return all(created)

    def _push_initial(self, values: torch.Tensor, shard: ShardSlice, after: object) -> None:
        # The daemons' master starts as the compute copy widened to fp32 (exact), on the host.
        with self.mover.host_copy(values, shard, after) as host:
            piece = host.to(torch.float32)
            self.client.push(shard, Push.parameters(self.client.model, shard.shard_id, byte_view(piece)))

    def run_all(self, fn: Callable[[ShardSlice], object]) -> list:
        futures = [self.pool.submit(fn, s) for s in self.plan]
        return [f.result() for f in futures]

    # -- a step --------------------------------------------------------------------------

    def push_part(
        self, shard: ShardSlice, step: int, grads: torch.Tensor, expected: StepSettings | None = None
    ) -> Future:
        """Starts pushing the shard's gradient as part 0 of `step` (GRADIENT_PART: the daemon
        holds it until an APPLY); the future gives the acknowledgement. `expected`: the
        settings step() is expected to send; the daemon may compute the step with them now
        (speculate) and adopt it when the APPLY names the same (ps_offload.daemon.store.speculation)."""
        after = self.mover.mark_compute()  # the copy follows the backward that wrote it
        return self.pool.submit(self._push_part, shard, step, grads, after, expected)

    def _push_part(
        self, shard: ShardSlice, step: int, grads: torch.Tensor, after: object, expected: StepSettings | None
    ) -> ps_pb2.PushResponse:
        groups, multiplier = expected if expected is not None else ((), None)
        with self.mover.host_view(grads, shard, after) as data:
            push = Push.gradient_part(
                self.client.model, shard.shard_id, data, step=step, part=0, encoding=self.mover.gradient_encoding,
                speculate=expected,
            )  # fmt: skip
            ack = self.client.push(shard, push)
            return self.counted(ack, len(data))

    def counted(self, ack: ps_pb2.PushResponse, nbytes: int) -> ps_pb2.PushResponse:
        """Counts a push's payload in bytes_pushed when the daemon took it (not a duplicate)."""
        if ack.applied:
            with self._bytes_lock:
                self.bytes_pushed += nbytes
        return ack

    def submit(
        self,
        step: int,
        settings: StepSettings,
        *,
        grads: torch.Tensor,
        params: torch.Tensor,
        parts: dict[int, Future] | None = None,
    ) -> tuple[list[Future], dict[int, Future]]:
        """One task per shard, in forward order: push its gradient (this process's share)
        and then pull its new version into `params`, or only pull the version another process
        pushes. A shard with an early part in `parts` (pushed during backward) is applied
        with an APPLY instead of pushed whole. Returns the push acknowledgements and, per
        shard, the pull.

        Push and pull share a task because, on a daemon whose state exceeds its RAM, the
        shard is still resident right after its push; pulled later, it would be read back
        from disk (measured: twice the state read per step instead of once)."""
        pushes: list[Future] = []
        pulls: dict[int, Future] = {}
        # The copies follow the work queued on the device. Once one shard's call has failed
        # (after its retries), the step has failed: the shards still queued give up at once
        # instead of each waiting out its own retries against a daemon that is down.
        tasks = _StepTasks(step, settings, grads, params, self.mover.mark_compute(), threading.Event())
        parts = parts or {}
        for shard in self.plan:
            if shard.shard_id in self.pushes:
                pushed = Future()
                pushes.append(pushed)
                task = self.pool.submit(self._push_then_pull, tasks, shard, pushed, parts.get(shard.shard_id))
            else:
                task = self.pool.submit(self.step_pull, shard, step + 1, params, tasks.after, tasks.failed)
            pulls[shard.shard_id] = task
        return pushes, pulls

    def hint_after(self, pulls: list[Future]) -> None:
        if self.client.config.prefetch_hints and self.hints and self.client.nvme_daemons:
            # Submitted after the pulls, so they have all left the queue (FIFO) when this
            # task starts waiting on them: it cannot hold up a pull it waits for.
            self.pool.submit(self._hint_next_step, pulls)

    def _hint_next_step(self, pulls: list[Future]) -> None:
        """Once this step's pulls are in, the daemons are idle until the next step's
        pushes: hint those, in push order (plan order)."""
        wait(pulls)
        if all(f.exception() is None for f in pulls):
            self.client.hint([s.shard_id for s in self.plan])

    def _push_then_pull(self, tasks: _StepTasks, shard: ShardSlice, pushed: Future, part: Future | None) -> int:
        # On the node's own daemon the update itself writes the new values where the trainer
        # reads them (PullInto): into the model's buffer held in shared memory, or, staged, a
        # spare host buffer that then goes up to the device. No pull, no second pass.
        with contextlib.ExitStack() as held:
            place = _PullPlace(self.mover, tasks.params, shard, held)
            ack = self._push(tasks, shard, pushed, part, place)
            if ack.pulled:
                place.target.land(tasks.after)
                return self._landed(shard, ack.version, tasks.step + 1, tasks.failed)
        return self.step_pull(shard, tasks.step + 1, tasks.params, tasks.after, tasks.failed)

    def _push(
        self, tasks: _StepTasks, shard: ShardSlice, pushed: Future, part: Future | None, place: _PullPlace
    ) -> ps_pb2.PushResponse:
        step = tasks.step
        try:
            if tasks.failed.is_set():
                raise StepAbandoned(f"push of shard {shard.shard_id} step {step} not sent: another shard failed")
            if part is not None and part.exception() is None:  # waits for the early part
                groups, multiplier = tasks.settings
                push = Push.apply(
                    self.client.model, shard.shard_id, step=step, parts=1, groups=groups, grad_multiplier=multiplier
                )
                ack = self.client.push(shard, push, pull_into=place.pull_into())
            else:  # no early part, or it failed: the whole gradient (it replaces any part held)
                ack = self.counted(*self._push_gradient(tasks, shard, place))
        except BaseException as exc:
            tasks.failed.set()
            pushed.set_exception(exc)
            raise
        pushed.set_result(ack)
        return ack

    def _push_gradient(
        self, tasks: _StepTasks, shard: ShardSlice, place: _PullPlace
    ) -> tuple[ps_pb2.PushResponse, int]:
        step, grads, after = tasks.step, tasks.grads, tasks.after
        groups, multiplier = tasks.settings
        # Compressed here, in the pool: shard i is compressed while shard i-1 is on the wire.
        # On an accelerator the kernels run on a side stream after `after` (this thread's own
        # current stream is not the compute stream), and are done when `following` returns.
        payload = None
        if self.compressor is not None:
            with self.mover.following(after):
                payload = self.compressor.payload(shard, step, grads)
        if payload is not None:
            momentum = payload.kind == ps_pb2.MOMENTUM  # 1-bit Adam: one lr, no groups
            if momentum:  # (1-bit Adam's step has its own kernel: no pull with it)
                push = Push.momentum(
                    self.client.model, shard.shard_id, payload.data, step=step, encoding=payload.encoding,
                    lr=groups[0].lr, variance_frozen_at=payload.variance_frozen_at,
                )  # fmt: skip
                return self.client.push(shard, push), len(payload.data)
            push = Push.gradient(
                self.client.model, shard.shard_id, payload.data, step=step, encoding=payload.encoding, groups=groups
            )
            ack = self.client.push(shard, push, pull_into=place.pull_into())
            return ack, len(payload.data)
        with self.mover.host_view(grads, shard, after) as data:
            push = Push.gradient(
                self.client.model, shard.shard_id, data, step=step, encoding=self.mover.gradient_encoding,
                groups=groups, grad_multiplier=multiplier,
            )  # fmt: skip
            ack = self.client.push(
                shard, push, pull_into=place.pull_into()
            )  # (asked once the gradient's buffer is held)
            return ack, len(data)

    def step_pull(
        self, shard: ShardSlice, version: int, params: torch.Tensor, after: object, failed: threading.Event
    ) -> int:
        """A step's pull: the shard at exactly `version` (its push's step + 1). A newer one
        means another process stepped the shard meanwhile (a second trainer of the same
        model): said, not trained on."""
        return self._landed(shard, self.pull(shard, version, params, after, failed), version, failed)

    def _landed(self, shard: ShardSlice, got: int, version: int, failed: threading.Event) -> int:
        """A step's pull (or the push that carried it) landed at `got`: it must be `version`."""
        if got != version:
            failed.set()
            raise RuntimeError(
                f"shard {shard.shard_id} of model {self.client.model!r} is at version {got} where this trainer's step "
                f"made it {version}: another trainer is stepping the same model (two jobs with one model_name?)"
            )
        return got

    def pull(
        self, shard: ShardSlice, version: int, params: torch.Tensor, after: object, failed: threading.Event | None
    ) -> int:
        """Pulls the shard at `version` or later into its slice of `params`; returns the version."""
        if failed is not None and failed.is_set():
            raise StepAbandoned(f"pull of shard {shard.shard_id} version {version} not sent: another shard failed")
        try:
            return self.mover.pull(
                params, shard, after,
                lambda into: self.client.pull(shard, min_version=version, out=into, dtype=self.mover.wire_dtype),
            )  # fmt: skip
        except BaseException:
            if failed is not None:
                failed.set()
            raise

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()


class _PullPlace:
    """A push's PullInto place, asked for only once the push holds what it must wait for (its
    gradient's host buffer): a spare host buffer is then taken without waiting, so transfers
    that each hold one never wait on each other for a second. Held until `held` closes."""

    def __init__(self, mover: ShardMover, params: torch.Tensor, shard: ShardSlice, held: contextlib.ExitStack) -> None:
        self._mover, self._params, self._shard, self._held = mover, params, shard, held
        self.target: PullTarget | None = None  # (None also when no spare buffer was free)
        self._asked = False

    def pull_into(self) -> PullInto | None:
        if not self._asked:
            self._asked = True
            self.target = self._held.enter_context(self._mover.pull_target(self._params, self._shard))
        return PullInto(self.target.view, self._mover.wire_dtype) if self.target is not None else None


def blocked_wait(futures: list[Future]) -> float:
    """Waits for `futures` to finish; the seconds the caller was blocked (0.0 when all had)."""
    if all(f.done() for f in futures):
        return 0.0
    started = time.perf_counter()
    wait(futures)
    return time.perf_counter() - started


def first_error(futures: list[Future]) -> BaseException | None:
    """The error that failed the step (not the calls abandoned because of it)."""
    return first_failure([f.exception() for f in futures if f.exception() is not None])


def first_failure(errors: list[BaseException]) -> BaseException | None:
    """Of a step's errors, the one that failed it (not the calls abandoned because of it)."""
    return next((e for e in errors if not isinstance(e, StepAbandoned)), errors[0] if errors else None)
