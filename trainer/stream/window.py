"""Which streamed blocks are on the trainer's device, and the pulls that bring them there.

`BlockWindow` is the streamed optimizer's (trainer/stream/optimizer.py) pull half: a block is fetched
(its buffer allocated, its shards' pulls started in the I/O pool) when a hook needs it or a
prefetch reaches it, waited for before its forward or backward, and released (its pulls
waited out, its memory freed) after. Prefetch walks the order the first forward ran the
blocks in, forward after a block's forward and backward after its backward began, while the
blocks held fit `window_bytes`; the running block is always allowed, so a window smaller than
a block means no prefetch, not no progress. Within the same budget, the blocks a forward
ends with stay for the backward that begins with them, and a step ends by fetching the
blocks the next forward begins with. In backward, the block just past the window is hinted
to its daemons (ShardedClient.hint), which load its shards' arenas from NVMe into RAM while
the blocks before it compute: its pull then reads RAM, not disk, and so does its push.

Each pull asks for the optimizer's current version (`version`) and refuses a newer one: the
daemons hold only their newest state, so a newer version means another trainer is stepping
the model, and the gradients computed here would be taken at parameters it never had.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, wait

import torch

from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.io.device import ShardMover
from ps_offload.trainer.io.shard_io import blocked_wait, first_error
from ps_offload.trainer.stream.units import StreamUnit
from ps_offload.trainer.wire.sharded_client import ShardedClient


class BlockWindow:
    def __init__(
        self,
        units: list[StreamUnit],
        *,
        client: ShardedClient,
        mover: ShardMover,
        pool,
        window_bytes: int,
        prefetch: bool,
    ) -> None:
        self.units = units
        self.client = client
        self.mover = mover
        self.pool = pool
        self.window_bytes = window_bytes
        self.prefetch_enabled = prefetch
        self.version = 0
        self._lock = threading.Lock()
        self._pulls: dict[int, list[Future]] = {}  # unit index -> its shards' pulls
        self._versions: dict[int, int] = {}  # unit index -> its version counter before its pulls
        self._hinted: set[int] = set()  # units whose arenas the daemons were asked to load, this backward
        self.order = [u for u in units if u.streamed]  # refined by the first forward
        self._recording: list[StreamUnit] | None = []
        # Block pulls started ahead of use and when a hook needed them; the most bytes of
        # blocks held at once; the seconds the caller's thread waited for pulls (a block or the
        # resident parameters needed before their pulls were done: latency prefetch did not hide).
        self.stats: dict[str, float] = {
            "prefetched": 0, "on_demand": 0, "peak_block_bytes": 0, "pull_wait_seconds": 0.0,
        }  # fmt: skip

    # -- the prefetch order ----------------------------------------------------------------

    def record(self, unit: StreamUnit) -> None:
        """A block's forward began (before the order is fixed)."""
        if self._recording is not None and unit not in self._recording:
            self._recording.append(unit)

    def fix_order(self) -> None:
        """The first backward began: the first forward's order is the prefetch order."""
        if self._recording:
            self.order = self._recording + [u for u in self.order if u not in self._recording]
        self._recording = None

    # -- pulls ---------------------------------------------------------------------------

    def submit_pulls(self, unit: StreamUnit, version: int) -> list[Future]:
        """The unit's pulls, started: in place, a daemon's shards go as one batch (one task);
        staged, each shard has a task (and a host buffer) of its own."""
        after = self.mover.mark_compute()
        outs = [self.mover.in_place(unit.values, unit.local(s)) for s in unit.shards]
        if any(out is None for out in outs):
            return [self.pool.submit(self._pull, unit, s, version, after) for s in unit.shards]
        return [
            self.pool.submit(self._pull_batch, [unit.shards[i] for i in group], [outs[i] for i in group], version)
            for group in self.client.batches(unit.shards)
        ]

    def _pull_batch(self, shards: list[ShardSlice], outs: list[memoryview], version: int) -> int:
        got = self.client.pull_batch(shards, outs, min_version=version, dtype=self.mover.wire_dtype)
        for shard, result in zip(shards, got, strict=True):
            if isinstance(result, BaseException):
                raise result
            self._check_version(shard, result, version)
        return version

    def _pull(self, unit: StreamUnit, shard: ShardSlice, version: int, after: object) -> int:
        got = self.mover.pull(
            unit.values, unit.local(shard), after,
            lambda into: self.client.pull(shard, min_version=version, out=into, dtype=self.mover.wire_dtype),
        )  # fmt: skip
        self._check_version(shard, got, version)
        return got

    def _check_version(self, shard: ShardSlice, got: int, version: int) -> None:
        if got != version:
            raise RuntimeError(
                f"shard {shard.shard_id} of {self.client.model!r} is at version {got}, this trainer at {version}: "
                "another trainer is stepping the same model"
            )

    def fetch(self, unit: StreamUnit, *, ahead: bool = False) -> list[Future]:
        """Starts pulling a unit unless it is here or on its way; returns its pulls."""
        with self._lock:
            pulls = self._pulls.get(unit.index)
            if pulls is not None:
                return pulls
            unit.allocate()
            self._versions.setdefault(unit.index, unit.values._version)
            pulls = self._pulls[unit.index] = self.submit_pulls(unit, self.version)
            if unit.streamed:
                self.stats["prefetched" if ahead else "on_demand"] += 1
                self.stats["peak_block_bytes"] = max(self.stats["peak_block_bytes"], self._held_locked())
            return pulls

    def _held_locked(self) -> int:
        return sum(u.nbytes for u in self.order if u.index in self._pulls)

    def ready(self, unit: StreamUnit) -> None:
        """Waits until the unit's values are here (fetching it first if need be)."""
        pulls = self.fetch(unit)
        self._wait(pulls)
        self._restore_version(unit, forget=False)
        wait_all(pulls)

    def _restore_version(self, unit: StreamUnit, *, forget: bool) -> None:
        """Once a unit's pulls are done: its version counter as before them. Autograd checks
        the counter of the views it saved for backward, and a pull writes the same values
        again. (Per unit, not per pull: pulls of one unit's shards run at once, and a
        counter saved and set back by each would race.)"""
        with self._lock:
            version = self._versions.pop(unit.index, None) if forget else self._versions.get(unit.index)
        if version is not None:
            torch._C._autograd._unsafe_set_version_counter((unit.values,), (version,))

    @contextlib.contextmanager
    def held(self, unit: StreamUnit) -> Iterator[None]:
        """The unit's values, here for the block (a streamed unit is pulled and released)."""
        if not unit.streamed:
            yield
            return
        self.ready(unit)
        try:
            yield
        finally:
            self.release(unit)

    def release(self, unit: StreamUnit) -> None:
        """Frees a streamed unit (a resident one keeps its memory) once its pulls are done."""
        with self._lock:
            pulls = self._pulls.pop(unit.index, None)
        if pulls is not None:
            self._wait(pulls)  # a pull still writing must not land in freed memory
        self._restore_version(unit, forget=True)
        unit.release()

    def release_all(self) -> None:
        for unit in self.order:
            if unit.index in self._pulls:
                self.release(unit)

    def prefetch(self, unit: StreamUnit, *, forward: bool) -> None:
        """Fetches the blocks after `unit` (before it, in backward) while they fit the window."""
        if not self.prefetch_enabled or unit not in self.order:
            return
        at = self.order.index(unit)
        ahead = self.order[at + 1 :] if forward else reversed(self.order[:at])
        for nxt in ahead:
            with self._lock:
                here = nxt.index in self._pulls
                full = self._held_locked() + nxt.nbytes > self.window_bytes
            if not here and full:
                if not forward:
                    self._hint(nxt)
                break
            self.fetch(nxt, ahead=True)

    def _hint(self, unit: StreamUnit) -> None:
        """In backward, the block after those the window holds: its daemons (those with an NVMe
        tier) are asked to load its shards' arenas into RAM now, a block before its pull, so
        that the pull is served from RAM instead of reading the master from disk, and its
        gradient's push finds the arena there; once per block per backward, off this thread."""
        with self._lock:
            if unit.index in self._hinted:
                return
            self._hinted.add(unit.index)
        self.pool.submit(self.client.hint, [s.shard_id for s in unit.shards])

    def needed_first_in_backward(self, unit: StreamUnit) -> bool:
        """Whether `unit` is among the last blocks of the forward order that fit the window
        together: backward needs them first, so they may stay after their forward."""
        if not self.prefetch_enabled or unit not in self.order:
            return False
        tail = self.order[self.order.index(unit) :]
        return sum(u.nbytes for u in tail) <= self.window_bytes

    def prefetch_first(self) -> None:
        """After a step: fetches the first blocks of the forward order that fit the window."""
        with self._lock:
            self._hinted.clear()  # the next backward hints again
        if not self.prefetch_enabled:
            return
        held = 0
        for unit in self.order:
            held += unit.nbytes
            if held > self.window_bytes:
                break
            self.fetch(unit, ahead=True)

    def pull_resident(self) -> None:
        """Starts pulling the resident units at `version` (after a step)."""
        for unit in self.units:
            if not unit.streamed:
                with self._lock:
                    self._versions.setdefault(unit.index, unit.values._version)
                    self._pulls[unit.index] = self.submit_pulls(unit, self.version)

    def wait_resident(self) -> None:
        for unit in self.units:
            if not unit.streamed:
                with self._lock:
                    pulls = self._pulls.pop(unit.index, None)
                if pulls is not None:
                    self._wait(pulls)
                    self._restore_version(unit, forget=True)
                    wait_all(pulls)

    def _wait(self, pulls: list[Future]) -> None:
        """Waits for `pulls` to finish, counting the time in stats["pull_wait_seconds"]."""
        if waited := blocked_wait(pulls):
            with self._lock:
                self.stats["pull_wait_seconds"] += waited


def wait_all(futures: list[Future]) -> list:
    """The futures' results, after all have finished; raises the first failure."""
    wait(futures)
    error = first_error(futures)
    if error is not None:
        raise error
    return [f.result() for f in futures]
