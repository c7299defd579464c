"""The RAM tier over NVMe: which shards are resident, within a byte budget.

Every committed version is already on disk (ps_offload.daemon.tiers.nvme writes through before the
ack), so a resident shard is always clean and evicting it is only dropping its memory. An
access pins its shard (`use`): if the shard is not resident, room is made by evicting the
least recently used unpinned shards and it is read from disk, outside the lock. Freed arena
buffers are kept for reuse (O_DIRECT needs page-aligned memory, and fresh pages fault), and
count against the budget like resident ones, so resident + pooled never exceeds it.

Prefetch takes an order of upcoming use (a trainer's hint, or the order the daemon saw last
step) and loads the first shards of it that are not resident, as far as room allows, in that
order, several at once: while the loads in flight hold fewer than `read_ahead_bytes` (the
NVMe readers' blocks in flight, ps_offload.daemon.tiers.direct_io), the next one starts, so a
step's small shards keep the disk as deep in reads as one large shard does. That
order also chooses what to evict: first the least recently used shard that is not upcoming
(already pushed this step), then the upcoming shard needed last; a prefetch never evicts a
shard needed before the one it loads, nor one an earlier prefetch brought in that nobody
has used yet. Queued loads start with the one needed soonest (not the first queued: a
trainer's hint for its next block, queued after the learned order's loads further ahead, is
needed before them). A load that finds no room waits until an update or a pull ends
(`waiting_for_room`); a queued shard used meanwhile (no longer upcoming) is dropped from the
queue. A push (`use`) takes a shard out of the order; a pull does not, since the order is of
pushes (the previous step's push order) and a shard pulled in backward is pushed next:
evicting it between the two would load it twice. A trainer's hint adds its shards after
those already upcoming; the learned order replaces the whole order at each push. Hits and
misses are counted at `use`.

`use_if_resident` pins a shard only if it is resident (or being loaded, which it waits for)
and loads nothing: a pull of the master values of a shard on NVMe reads them from disk
without a place in the tier (ps_offload.daemon.store.master_pull), so it counts as neither hit nor miss,
takes no room, evicts nothing and leaves the order of upcoming use alone.

Invariants (under `cond`): used + pooled <= budget; a shard is at most one of resident or
loading; a pinned shard is resident or loading; `lru` holds exactly the resident shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from ps_offload.daemon.errors import ResourceExhausted
from ps_offload.daemon.tiers.tier import TierStats

log = logging.getLogger(__name__)

MAX_PREFETCH_LOADS = 8  # shards loading at once, however small (each is a load call, a thread)


class TierFull(ResourceExhausted):
    """Every resident shard is pinned and the budget has no room for another (the caller's
    request is refused as RESOURCE_EXHAUSTED, with this message)."""


class RamTier:
    def __init__(
        self,
        *,
        budget: int,
        allocate: Callable[[int], object],
        load: Callable[[object, object], None],
        wait_timeout: float = 60.0,
        read_ahead_bytes: int = 0,
    ) -> None:
        """allocate(nbytes) -> buffer; load(shard, buffer) attaches the buffer to the shard
        and reads its committed version into it (raising on failure). `read_ahead_bytes`:
        prefetch loads start while those in flight hold fewer bytes (0: one at a time)."""
        self.budget = budget
        self._allocate = allocate
        self._load = load
        self.wait_timeout = wait_timeout
        self.cond = threading.Condition()
        self.lru: OrderedDict[object, None] = OrderedDict()
        self.used = 0
        self.pool: dict[int, list[object]] = {}
        self.pooled = 0
        self.stats = TierStats()
        self._protected: set[object] = set()  # prefetched, not used yet
        self._upcoming: dict[str, dict[object, int]] = {}  # per model: shard -> position in its order
        self._queue: deque = deque()
        self.read_ahead_bytes = read_ahead_bytes
        self._loads, self._loading_bytes = 0, 0  # prefetch loads in flight, and their arenas' bytes
        self.waiting_for_room: object | None = None  # the queued shard the loader waits to find room for
        self._loaders = ThreadPoolExecutor(max_workers=MAX_PREFETCH_LOADS, thread_name_prefix="prefetch-load")
        self._prefetcher = threading.Thread(target=self._prefetch_loop, name="prefetch", daemon=True)
        self._stopping = False
        self._prefetcher.start()

    # -- access -----------------------------------------------------------------------

    @contextlib.contextmanager
    def use(self, shard, *, pull: bool = False) -> Iterator[None]:
        """Pins `shard` resident for the block; loads it first if needed. `pull`: a read that
        leaves the shard in the order of upcoming use (its push is still to come)."""
        buffer = self._pin(shard, pull=pull)
        if buffer is not None:
            self._fill(shard, buffer)
        try:
            yield
        finally:
            self._unpin(shard)

    @contextlib.contextmanager
    def use_if_resident(self, shard) -> Iterator[bool]:
        """Pins `shard` for the block and yields True if it is resident, or once it is if it
        is being loaded; yields False, having pinned and counted nothing, if it is on NVMe
        only (or its load failed, or took longer than `wait_timeout`)."""
        with self.cond:
            self.cond.wait_for(lambda: not shard.loading, self.wait_timeout)
            pinned = shard.resident
            if pinned:
                self._pin_resident_locked(shard, pull=True)
        try:
            yield pinned
        finally:
            if pinned:
                self._unpin(shard)

    def _unpin(self, shard) -> None:
        with self.cond:
            shard.pins -= 1
            self.cond.notify_all()

    def _pin_resident_locked(self, shard, *, pull: bool) -> None:
        """Under cond: a use of a resident shard (a hit)."""
        shard.pins += 1
        self.lru.move_to_end(shard)
        self.stats.hits += 1
        self._protected.discard(shard)
        if not pull:
            self._used(shard)

    def _pin(self, shard, *, pull: bool) -> object | None:
        """Pins the shard; returns a buffer to load it into when this caller must load it."""
        with self.cond:
            while True:
                shard.check_not_dropped()
                if shard.resident:
                    self._pin_resident_locked(shard, pull=pull)
                    return None
                if not shard.loading:
                    buffer = self._take_room(shard.arena_bytes, evict_protected=True)
                    if buffer is not None:
                        shard.loading = True
                        shard.pins += 1
                        self.stats.misses += 1
                        if not pull:
                            self._used(shard)
                        return buffer
                if not self.cond.wait(self.wait_timeout):
                    raise TierFull(
                        f"the RAM tier ({self.budget} bytes) has had no room for a shard of "
                        f"{shard.arena_bytes} bytes for {self.wait_timeout:.0f}s: every resident shard is in "
                        "use. Raise store.ram_bytes or send fewer concurrent requests"
                    )

    def _fill(self, shard, buffer: object) -> None:
        try:
            self._load(shard, buffer)
        except BaseException:
            with self.cond:
                shard.loading = False
                shard.pins -= 1
                self._give_back(shard.arena_bytes, buffer)
                self.cond.notify_all()
            raise
        with self.cond:
            shard.loading = False
            shard.resident = True
            self.lru[shard] = None
            self.cond.notify_all()

    # -- room -------------------------------------------------------------------------

    def _used(self, shard) -> None:
        upcoming = self._upcoming.get(shard.model)
        if upcoming:
            upcoming.pop(shard, None)

    def _victim(self, *, evict_protected: bool, before: int | None) -> object | None:
        """Under cond: the shard to evict, or None. Unpinned shards only; the least recently
        used one that is not upcoming, else the upcoming one needed last, but not one needed
        at or before position `before` of its model's order (None: no such limit)."""
        chosen, chosen_at = None, -1
        for shard in self.lru:  # least recently used first
            if shard.pins or (not evict_protected and shard in self._protected):
                continue
            at = self._upcoming.get(shard.model, {}).get(shard)
            if at is None:
                return shard
            if before is not None and at <= before:
                continue
            if at > chosen_at:
                chosen, chosen_at = shard, at
        return chosen

    def _take_room(self, nbytes: int, *, evict_protected: bool, before: int | None = None) -> object | None:
        """Under cond: a buffer of nbytes within the budget, evicting as needed; None when
        not possible now."""
        pooled = self.pool.get(nbytes)
        if pooled:
            self.pooled -= nbytes
            self.used += nbytes
            return pooled.pop()
        while self.used + self.pooled + nbytes > self.budget:
            if self.pooled:
                self._drop_pooled()
                continue
            victim = self._victim(evict_protected=evict_protected, before=before)
            if victim is None:
                return None
            self._evict(victim)
            pooled = self.pool.get(nbytes)
            if pooled:  # the victim's buffer fits
                self.pooled -= nbytes
                self.used += nbytes
                return pooled.pop()
        self.used += nbytes
        return self._allocate(nbytes)

    def _evict(self, shard) -> None:
        del self.lru[shard]
        self._protected.discard(shard)
        shard.resident = False
        buffer = shard.detach()
        self.stats.evictions += 1
        self._give_back(shard.arena_bytes, buffer)

    def _give_back(self, nbytes: int, buffer: object) -> None:
        self.used -= nbytes
        self.pool.setdefault(nbytes, []).append(buffer)
        self.pooled += nbytes

    def _drop_pooled(self) -> None:
        for nbytes, buffers in self.pool.items():
            if buffers:
                buffers.pop()
                self.pooled -= nbytes
                return

    def evict(self, shard) -> bool:
        """Drops a resident, unpinned shard from RAM (ps-admin evict); False if pinned."""
        with self.cond:
            if not shard.resident:
                return True
            if shard.pins:
                return False
            self._evict(shard)
            self.cond.notify_all()
            return True

    def forget(self, shards: list, timeout: float) -> int:
        """Frees the arenas of a dropped model's shards (ps_offload.daemon.store.drop), once loads of them
        in progress have ended, and forgets their places in the LRU and the prefetch queue.
        Returns the bytes freed; raises TimeoutError if a load outlasts `timeout`."""
        gone = set(shards)
        with self.cond:
            self._queue = deque(s for s in self._queue if s not in gone)
            if shards:
                self._upcoming.pop(shards[0].model, None)
            if not self.cond.wait_for(lambda: not any(s.pins or s.loading for s in shards), timeout):
                raise TimeoutError(f"a load of one of {len(shards)} shards did not end in {timeout:.0f}s")
            freed = 0
            for shard in shards:
                self._protected.discard(shard)
                if shard.resident:
                    del self.lru[shard]
                    shard.resident = False
                    shard.detach()  # not pooled: a dropped model's memory goes back to the system
                    self.used -= shard.arena_bytes
                    freed += shard.arena_bytes
            self.cond.notify_all()
            return freed

    # -- prefetch ---------------------------------------------------------------------

    def prefetch(self, shards: list, *, limit: int | None = None, after_upcoming: bool = False) -> int:
        """`shards` (of one model) will be used in this order: loads the first `limit` of
        them that are not resident (None: as many as there is room for). Returns how many
        were queued. The order replaces the model's order of upcoming use, or with
        `after_upcoming` (a trainer's hint) follows the shards already in it."""
        with self.cond:
            if shards:
                upcoming = self._upcoming.get(shards[0].model, {}) if after_upcoming else {}
                at = max(upcoming.values(), default=-1) + 1
                for shard in shards:
                    if shard not in upcoming:
                        upcoming[shard], at = at, at + 1
                self._upcoming[shards[0].model] = upcoming
            queued = [s for s in shards if not s.resident and not s.loading and s not in self._queue]
            queued = queued[:limit] if limit is not None else queued
            self._queue.extend(queued)
            self.cond.notify_all()
            return len(queued)

    def _prefetch_loop(self) -> None:
        while True:
            with self.cond:
                while not self._stopping and not (self._queue and self._room_to_load_locked()):
                    self.cond.wait()
                if self._stopping:
                    return
                shard = self._soonest_queued_locked()
                at = self._upcoming.get(shard.model, {}).get(shard)
                if at is None or shard.resident or shard.loading or shard.corrupt or shard.dropped:
                    continue  # (no longer upcoming: used since it was queued)
                # Never evict what an earlier prefetch brought in and nobody used yet, nor
                # what is needed before this shard.
                buffer = self._take_room(shard.arena_bytes, evict_protected=False, before=at)
                if buffer is None:
                    # No room now: every other arena is pinned or needed sooner. An update
                    # ending gives some back; until something changes, this load waits at
                    # the head of the queue (the ones behind it are needed later still).
                    self._queue.appendleft(shard)  # (still the soonest)
                    self.waiting_for_room = shard
                    self.cond.wait()
                    self.waiting_for_room = None
                    continue
                shard.loading = True
                shard.pins += 1
                self._loads, self._loading_bytes = self._loads + 1, self._loading_bytes + shard.arena_bytes
            self._loaders.submit(self._prefetch_one, shard, buffer)

    def _soonest_queued_locked(self):
        """Under cond: takes the queued shard needed soonest out of the queue (the first in its
        model's order of upcoming use; one no longer upcoming first, to be dropped)."""
        shard = min(self._queue, key=lambda s: self._upcoming.get(s.model, {}).get(s, -1))
        self._queue.remove(shard)
        return shard

    def _room_to_load_locked(self) -> bool:
        """Under cond: whether another prefetch load may start (one always may)."""
        return self._loads == 0 or (self._loads < MAX_PREFETCH_LOADS and self._loading_bytes < self.read_ahead_bytes)

    def _prefetch_one(self, shard, buffer: object) -> None:
        loaded = False
        try:
            self._fill(shard, buffer)  # (unpins the shard itself when it fails)
            loaded = True
        except Exception as exc:  # noqa: BLE001 - a failed prefetch is retried by the access
            log.warning("prefetch of shard %s failed: %s", shard.slice.shard_id, exc)
        with self.cond:
            self._loads, self._loading_bytes = self._loads - 1, self._loading_bytes - shard.arena_bytes
            if loaded:
                shard.pins -= 1
                self._protected.add(shard)
                self.stats.prefetched += 1
            self.cond.notify_all()

    # -- what the store reads -----------------------------------------------------------

    def resident_bytes(self, shards: list) -> int:
        """The budget taken: resident arenas and pooled buffers (of `shards`: all there are)."""
        return self.used + self.pooled

    def counters(self) -> TierStats:
        with self.cond:
            return dataclasses.replace(self.stats)

    def close(self) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: self._loads == 0, 5)  # loads in flight read files about to close
        self._prefetcher.join(5)
        self._loaders.shutdown(wait=False)
