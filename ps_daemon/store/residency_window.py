"""Which master pulls of a shard on NVMe load its whole arena into RAM: those whose update
comes soon enough that the RAM tier can keep the shard from this pull to that update.

Why. A streamed trainer (trainer/stream/optimizer.py) pulls each block's master values before
its forward and again before its backward, then pushes its gradient. A master pull of a shard
on NVMe reads the master region only (ps_offload.daemon.store.master_pull: 4 of AdamW's 12
bytes per parameter), and the update loads the whole arena: 16 bytes read per parameter where
12 would do if the arena stayed in RAM from the pull to the update. It can stay only while the
tier holds every shard updated between the two: for the blocks a forward pulls last (the ones
its backward updates first) that is a few blocks; for the first blocks, the whole model.

The rule. The learned order of updates (ps_offload.daemon.store.prefetch: the previous step's
push order) says which shards of the model are updated before the pulled one. If their arenas
and its own fit in the *window*, the pull loads the shard whole (a tier miss, counted in
`window_loads`), and the tier keeps it: the order of upcoming use is set to that learned order,
so it is evicted only after the shards needed later (ps_offload.daemon.tiers.ram's victim rule).
Else the master region alone is read, as before. The shards the next `depth` + 1 updates take
(a backward's pull that prefetch did not reach; pushes come in an order a little different
from last step's, so not only the very next) are always loaded whole, in the room kept for the
update in flight and the prefetch, and so is one whose predecessors are all in RAM already (a
backward pulls a block's shards together): a backward pull reads its shard once, for the pull
and the update both.

The window: the RAM tier's budget less room for the prefetch of `depth` shards ahead and one
update in flight (`depth + 1` of the model's largest arenas), shared evenly among the models
registered here. Without a learned order (the first step, `store.prefetch_depth = 0`, a model whose
trainer changed its order) every master pull reads the master only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ps_offload.daemon.store.prefetch import Prefetcher
from ps_offload.daemon.store.shard import Shard


@dataclass(frozen=True)
class WindowPlan:
    """How many bytes of one model's arenas the RAM tier keeps from their pull to their update,
    and how many of its shards that is (the largest ones first: the least it holds; at least the
    shard updated next, in the room kept for the update in flight)."""

    window_bytes: int
    shards: int


def plan_window(budget: int, arenas: list[int], *, depth: int, models: int) -> WindowPlan:
    """The window of a model whose shards' arenas are `arenas` bytes, on a tier of `budget`
    bytes shared by `models` models, prefetching `depth` shards ahead."""
    if not arenas:
        return WindowPlan(0, 0)
    window = _window_bytes(budget, max(arenas), depth=depth, models=models)
    taken = held = 0
    for nbytes in sorted(arenas, reverse=True):
        if taken + nbytes > window:
            break
        taken, held = taken + nbytes, held + 1
    return WindowPlan(window, max(held, 1))  # the shard updated next is always held


def updates_at_once(budget: int, arenas: list[int], *, depth: int, models: int, most: int) -> int:
    """How many of a model's updates may hold their arenas in RAM at once (a local batch's
    pushes side by side, ps_offload.daemon.dataplane.batch_runs, each pinned until its commit
    group is durable), at most `most`, without the room the window plans on: one (the update in
    flight the window keeps room for) unless the model's share of the tier holds all of its
    arenas, the prefetch's and the extra updates'. On a tier smaller than its models the window
    keeps its plan, and a connection's batch commits one shard at a time, as before: side by
    side at a tier of a quarter of the state, zero_infinity_small read 16% more a step (more
    of the window evicted) to save half its flushes, and ran slower (2026-12-07, by hand)."""
    if not arenas or most <= 1:
        return 1
    largest = max(arenas)
    spare = _window_bytes(budget, largest, depth=depth, models=models) - sum(arenas)  # beyond the model whole
    return max(1, min(most, 1 + spare // largest))


def _window_bytes(budget: int, largest_arena: int, *, depth: int, models: int) -> int:
    return max((budget - (depth + 1) * largest_arena) // max(models, 1), 0)


class ResidencyWindow:
    def __init__(
        self,
        prefetcher: Prefetcher,
        *,
        budget: int,
        shards_of: Callable[[str], dict[int, Shard]],
        models: Callable[[], int],
    ) -> None:
        """`shards_of(model)`: the model's shards here, by id; `models()`: how many models are
        registered here."""
        self.prefetcher = prefetcher
        self.budget = budget
        self._shards_of = shards_of
        self._models = models

    def plan(self, model: str) -> WindowPlan:
        arenas = [s.arena_bytes for s in self._shards_of(model).values()]
        return plan_window(self.budget, arenas, depth=self.prefetcher.depth, models=self._models())

    def updates_at_once(self, model: str, most: int) -> int:
        """updates_at_once() for `model` on this tier (1 for a model not registered here)."""
        arenas = [s.arena_bytes for s in self._shards_of(model).values()]
        return updates_at_once(self.budget, arenas, depth=self.prefetcher.depth, models=self._models(), most=most)

    def holds(self, shard: Shard) -> list[Shard] | None:
        """The shards still to be updated, in the learned order, when the window holds `shard`
        from now to its update (the caller loads it whole and makes that the tier's order of
        upcoming use); None when its pull should read the master only."""
        order = self.prefetcher.updates_before(shard)
        if order is None:
            return None
        remaining, before = order
        shards = self._shards_of(shard.model)
        if any(i not in shards for i in remaining):
            return None  # dropped or re-registered meanwhile
        # The shards the next `depth` + 1 updates take always fit, in the room kept for the
        # update in flight and the prefetch, which would read them whole before their updates
        # anyway (pushes come in an order a little different from last step's: the one pulled
        # need not be the very next). So does one whose every predecessor is in RAM already (a
        # backward pulling a block's shards together): nothing is loaded before its update, so
        # it is evicted only for shards needed sooner.
        depth, models = self.prefetcher.depth, max(self._models(), 1)
        needed = sum(shards[i].arena_bytes for i in before)
        if len(before) <= depth and needed + shard.arena_bytes <= self.budget // models:
            return [shards[i] for i in remaining]
        largest = max(s.arena_bytes for s in shards.values())
        window = _window_bytes(self.budget, largest, depth=depth, models=models)
        if needed + shard.arena_bytes > window:
            if not all(shards[i].resident or shards[i].loading for i in before):
                return None
        return [shards[i] for i in remaining]
