"""What the RAM tier loads ahead: shards a trainer hinted, and the shards not pushed yet this
step, in the previous step's push order (learned, per model). The same learned order
says, for a pull, which shards are updated before the pulled one (`updates_before`), which the
residency window reads (ps_offload.daemon.store.residency_window).

Both only queue loads (ps_offload.daemon.tiers.ram does them, bounded by its free room); without an
NVMe tier every shard is resident: the tier queues nothing, and the store learns no order (depth 0).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ps_offload.daemon.store.shard import Shard
from ps_offload.daemon.tiers.tier import ResidencyTier


class Prefetcher:
    def __init__(self, tier: ResidencyTier, *, depth: int) -> None:
        """depth: how many of the shards not pushed yet this step (in last step's order) to
        load as each push arrives (0: learn nothing)."""
        self.tier = tier
        self.depth = depth
        # Per model: (the step being pushed, the previous step's push order, this step's so far).
        self._orders: dict[str, tuple[int, list[int], list[int]]] = {}
        self._lock = threading.Lock()

    def hint(self, shards: list[Shard]) -> int:
        """A trainer's hint: these shards next, in this order, after those already upcoming.
        Returns how many were queued."""
        return self.tier.prefetch(shards, after_upcoming=True)

    def pushed(self, shard: Shard, step: int, shards_of_model: Callable[[], dict[int, Shard]]) -> None:
        """Records that `shard` is being pushed for `step`; makes the tier's order of upcoming
        use this shard, then the model's shards not pushed yet this step in last step's order,
        and queues the first `depth` of them not in RAM. Not what followed this shard last
        step: pushes that run at once arrive in a slightly different order each step, and that
        re-read shards already pushed and dropped from the order some not pushed yet (evicted
        first, then read again at their push). `shards_of_model`: the model's shards on this
        daemon, by id."""
        if not self.depth:
            return
        with self._lock:
            current_step, previous, current = self._orders.get(shard.model, (step, [], []))
            if step != current_step:
                previous, current = current, []
            current.append(shard.slice.shard_id)
            self._orders[shard.model] = (step, previous, current)
            if shard.slice.shard_id not in previous:
                return
            upcoming = [shard.slice.shard_id, *_not_pushed_yet(previous, current)]
        shards = shards_of_model()
        self.tier.prefetch([shards[i] for i in upcoming if i in shards], limit=self.depth)

    def updates_before(self, shard: Shard) -> tuple[list[int], list[int]] | None:
        """(the model's shard ids still to be updated in the step `shard`'s next update is for,
        in the learned order; of those, the ones updated before `shard`), or None when no order
        is learned yet or `shard` is not in it. That step is the shard's version: if updates of
        it have begun, the order is the previous step's less those done; if not, the last
        step's whole."""
        step = shard.version
        with self._lock:
            learned_step, previous, current = self._orders.get(shard.model, (None, [], []))
            if learned_step == step:
                remaining = _not_pushed_yet(previous, current)
            elif learned_step == step - 1:
                remaining = list(dict.fromkeys(current))
            else:
                return None
        shard_id = shard.slice.shard_id
        if shard_id not in remaining:
            return None
        return remaining, remaining[: remaining.index(shard_id)]


def _not_pushed_yet(previous: list[int], current: list[int]) -> list[int]:
    """The shards of last step's push order (`previous`) not pushed yet this step (`current`),
    in that order, each once."""
    done = set(current)
    return [i for i in dict.fromkeys(previous) if i not in done]
