"""The RAM tier's choices, in process: what a demand load and a prefetch evict, given the
order of upcoming use."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

from ps_offload.daemon.tiers.ram import RamTier

ARENA = 1000


class FakeShard:
    def __init__(self, shard_id: int, model: str = "m") -> None:
        self.model = model
        self.slice = SimpleNamespace(shard_id=shard_id)
        self.arena_bytes = ARENA
        self.resident = self.loading = False
        self.pins = 0
        self.corrupt = ""
        self.dropped = False
        self.buffer = None

    def check_not_dropped(self) -> None:
        if self.dropped:
            raise LookupError("dropped")

    def detach(self):
        buffer, self.buffer = self.buffer, None
        return buffer

    def __repr__(self) -> str:
        return f"shard{self.slice.shard_id}"


def _tier(slots: int) -> RamTier:
    def load(shard, buffer):
        shard.buffer = buffer

    return RamTier(budget=slots * ARENA, allocate=lambda n: bytearray(n), load=load)


def _touch(tier: RamTier, *shards: FakeShard) -> None:
    for shard in shards:
        with tier.use(shard):
            pass


def _resident(tier: RamTier) -> set[int]:
    return {s.slice.shard_id for s in tier.lru}


def _settle(tier: RamTier) -> None:
    """Until the loader is idle: nothing queued, or the first queued load waiting for room."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with tier.cond:
            if (not tier._queue or tier.waiting_for_room is not None) and tier._loads == 0:
                return
        time.sleep(0.01)
    raise AssertionError("the prefetch loader did not settle in 5 s")


def _until(what) -> None:
    """Until `what()` holds (the loader runs on its own thread; it wakes some time after the
    change that lets it go on)."""
    deadline = time.monotonic() + 5
    while not what():
        assert time.monotonic() < deadline, "not in 5 s"
        time.sleep(0.01)


def test_without_an_order_the_least_recently_used_shard_goes():
    tier = _tier(3)
    shards = [FakeShard(i) for i in range(4)]
    _touch(tier, shards[0], shards[1], shards[2], shards[0], shards[3])
    assert _resident(tier) == {0, 2, 3}  # 1 was least recently used
    assert tier.stats.misses == 4 and tier.stats.hits == 1 and tier.stats.evictions == 1
    tier.close()


def test_prefetch_in_hint_order_evicts_what_is_needed_last():
    tier = _tier(3)
    shards = [FakeShard(i) for i in range(5)]
    _touch(tier, *shards)  # a step: 2, 3, 4 stay resident
    assert _resident(tier) == {2, 3, 4}
    assert tier.prefetch(shards) == 2  # next step: 0 and 1 are not resident
    _settle(tier)
    # 0 and 1 came back in place of 4 and 3 (needed last); 2, needed next, stayed.
    assert _resident(tier) == {0, 1, 2}
    assert tier.stats.prefetched == 2
    _touch(tier, shards[0], shards[1], shards[2])
    assert tier.stats.hits == 3
    tier.close()


def test_prefetch_never_evicts_a_shard_needed_before_the_one_it_loads():
    tier = _tier(2)
    shards = [FakeShard(i) for i in range(4)]
    _touch(tier, shards[2], shards[1])
    tier.prefetch([shards[1], shards[2], shards[3], shards[0]])
    _settle(tier)
    assert _resident(tier) == {1, 2}  # 3 and 0 would have to evict 1 or 2
    assert tier.stats.prefetched == 0
    tier.close()


def test_a_prefetch_without_room_waits_for_an_update_to_end():
    """Every arena is pinned by an update: the load waits at the head of the queue, and starts
    when one ends (it used to be dropped, and its shard then read at its pull and again whole
    at its update)."""
    tier = _tier(2)
    updating, other, nxt, after = (FakeShard(i) for i in range(4))
    with contextlib.ExitStack() as updates:
        for shard in (updating, other):
            updates.enter_context(tier.use(shard))
        assert tier.prefetch([nxt, after]) == 2
        _until(lambda: tier.waiting_for_room is nxt)
        assert tier.stats.prefetched == 0
    _until(lambda: tier.stats.prefetched == 2)  # both updates ended: room for both loads
    assert _resident(tier) == {2, 3} and tier.stats.misses == 2
    tier.close()


def test_the_loader_takes_the_queued_shard_needed_soonest():
    """Queued loads wait for room in the order of use, not of their queueing: with room for one,
    the one needed first is read (first in, first out read a late one, which the next demand
    load then evicted and read again; zero_infinity_small read 6% more a step)."""
    tier = _tier(3)
    a, b, c, *upcoming = (FakeShard(i) for i in range(7))
    tier.prefetch(upcoming, limit=0)  # the order only
    with tier.use(a), tier.use(c):
        with tier.use(b):  # no room
            tier.prefetch([upcoming[3]], after_upcoming=True)
            tier.prefetch([upcoming[1]], after_upcoming=True)
            _until(lambda: tier.waiting_for_room is upcoming[1])
        _until(lambda: tier.stats.prefetched == 1)  # b done: room for one
        assert _resident(tier) == {0, 2, 4}
        _until(lambda: tier.waiting_for_room is upcoming[3])  # the other waits on
    tier.close()


def test_a_queued_shard_used_meanwhile_is_not_loaded_again():
    tier = _tier(3)
    updating, other, needed, late = (FakeShard(i) for i in range(4))
    tier.prefetch([needed, late])
    _settle(tier)
    assert _resident(tier) == {2, 3}
    tier.evict(late)
    with tier.use(updating), tier.use(other):  # no room for `late` now
        tier.prefetch([needed, late])
        _until(lambda: tier.waiting_for_room is late)
        _touch(tier, late)  # its push came first: loaded on demand, and no longer upcoming
        tier.evict(late)
    _until(lambda: not tier._queue)
    _settle(tier)
    assert 3 not in _resident(tier)
    assert tier.stats.prefetched == 2 and tier.stats.misses == 3  # updating, other, late once
    tier.close()


def test_a_shard_not_upcoming_goes_first_even_if_recently_used():
    tier = _tier(3)
    shards = [FakeShard(i) for i in range(4)]
    _touch(tier, shards[1], shards[2], shards[0])
    tier.prefetch([shards[1], shards[2], shards[3]])  # 0 is not upcoming: it goes first
    _settle(tier)
    assert _resident(tier) == {1, 2, 3}
    tier.close()


def test_a_shard_pulled_in_backward_stays_until_its_push_while_hints_load_the_next():
    """A streamed backward: each block's shards are hinted, loaded, pulled, then pushed, while
    the blocks after it are hinted. A pulled shard's push is still to come: a later hint must
    evict what was pushed, not it (the scale run loaded every shard twice when it did)."""
    tier = _tier(3)
    pushed, pulled, hinted, next_hint = (FakeShard(i) for i in range(4))
    tier.prefetch([pulled], after_upcoming=True)
    _settle(tier)
    with tier.use_if_resident(pulled) as found:  # its backward pull
        assert found
    _touch(tier, pushed)  # the block before it is pushed: now the most recently used
    for shard in (hinted, next_hint):
        tier.prefetch([shard], after_upcoming=True)
        _settle(tier)
    assert _resident(tier) == {1, 2, 3} and tier.stats.evictions == 1
    _touch(tier, pulled)  # its push: a hit, not a second load
    assert tier.stats.hits == 2 and tier.stats.misses == 1
    tier.close()


def test_a_pull_through_use_leaves_the_shard_upcoming_and_a_push_takes_it_out():
    tier = _tier(2)
    a, b, c = (FakeShard(i) for i in range(3))
    tier.prefetch([a, b])
    _settle(tier)
    with tier.use(a, pull=True):
        pass
    assert tier._upcoming["m"] == {a: 0, b: 1}
    _touch(tier, a)
    assert tier._upcoming["m"] == {b: 1}
    tier.prefetch([c], after_upcoming=True)  # no room: a (pushed) goes, not b
    _settle(tier)
    assert _resident(tier) == {1, 2} and tier._upcoming["m"] == {b: 1, c: 2}
    tier.close()


def test_prefetch_limit_loads_only_the_first_missing_shards():
    tier = _tier(4)
    shards = [FakeShard(i) for i in range(4)]
    assert tier.prefetch(shards, limit=2) == 2
    _settle(tier)
    assert _resident(tier) == {0, 1}
    tier.close()


def _counting_tier(read_ahead_bytes: int, *, together: int = 0):
    """A tier of 4 slots whose loads count how many run at once (`peak`); the first
    `together` of them wait for each other (a load that waits alone fails after 5 s)."""
    seen = {"now": 0, "peak": 0}
    lock, meet = threading.Lock(), threading.Barrier(max(together, 1))

    def load(shard, buffer):
        with lock:
            seen["now"] += 1
            seen["peak"] = max(seen["peak"], seen["now"])
        try:
            if shard.slice.shard_id < together:
                meet.wait(5)
            shard.buffer = buffer
        finally:
            with lock:
                seen["now"] -= 1

    tier = RamTier(budget=4 * ARENA, allocate=lambda n: bytearray(n), load=load, read_ahead_bytes=read_ahead_bytes)
    return tier, seen


def test_prefetch_keeps_loads_in_flight_up_to_the_read_ahead_bytes():
    tier, seen = _counting_tier(2 * ARENA, together=2)
    shards = [FakeShard(i) for i in range(4)]
    assert tier.prefetch(shards) == 4
    _settle(tier)
    # The first two loaded together (or they would have failed), never three at once.
    assert _resident(tier) == {0, 1, 2, 3} and tier.stats.prefetched == 4 and seen["peak"] == 2
    assert not any(s.pins or s.loading for s in shards) and tier._loading_bytes == 0
    tier.close()


def test_without_read_ahead_prefetch_loads_one_shard_at_a_time():
    tier, seen = _counting_tier(0)
    shards = [FakeShard(i) for i in range(4)]
    tier.prefetch(shards)
    _settle(tier)
    assert _resident(tier) == {0, 1, 2, 3} and seen["peak"] == 1
    tier.close()


def test_a_failed_prefetch_load_leaves_the_shard_unpinned_and_the_next_loads_going():
    def load(shard, buffer):
        if shard.slice.shard_id == 1:
            raise OSError("read failed")
        shard.buffer = buffer

    tier = RamTier(budget=4 * ARENA, allocate=lambda n: bytearray(n), load=load, read_ahead_bytes=2 * ARENA)
    shards = [FakeShard(i) for i in range(4)]
    assert tier.prefetch(shards) == 4
    _settle(tier)
    # Shard 1 is not resident and holds no pin or room; the others loaded past it.
    assert _resident(tier) == {0, 2, 3} and tier.stats.prefetched == 3
    assert not any(s.pins or s.loading for s in shards) and tier.used == 3 * ARENA
    assert tier._loads == 0 and tier._loading_bytes == 0
    with tier.use(shards[0]):  # a prefetched shard is used where it is
        pass
    assert tier.stats.hits == 1
    tier.close()


def test_use_if_resident_pins_a_resident_shard_and_leaves_one_on_nvme_where_it_is():
    tier = _tier(1)
    on_nvme, resident = FakeShard(0), FakeShard(1)
    _touch(tier, resident)
    tier.prefetch([resident, on_nvme])  # the order of upcoming use
    with tier.use_if_resident(on_nvme) as pinned:
        assert pinned is False and on_nvme.pins == 0
        assert not on_nvme.resident and resident.resident  # nothing loaded, nothing evicted
    assert (tier.stats.hits, tier.stats.misses, tier.stats.evictions) == (0, 1, 0)
    assert tier._upcoming["m"] == {resident: 0, on_nvme: 1}  # the order is left alone
    with tier.use_if_resident(resident) as pinned:
        assert pinned is True and resident.pins == 1 and not tier.evict(resident)  # pinned: it stays
    # Still upcoming: the order is of pushes, and a pulled shard's push is to come.
    assert resident.pins == 0 and tier.stats.hits == 1 and resident in tier._upcoming["m"]
    tier.close()


def test_use_if_resident_waits_for_a_load_in_progress_and_pins_what_it_loaded():
    loading, release = threading.Event(), threading.Event()

    def load(shard, buffer):
        loading.set()
        assert release.wait(5)
        shard.buffer = buffer

    tier = RamTier(budget=ARENA, allocate=lambda n: bytearray(n), load=load)
    shard = FakeShard(0)
    loader = threading.Thread(target=_touch, args=(tier, shard))
    loader.start()
    assert loading.wait(5)
    threading.Timer(0.1, release.set).start()
    with tier.use_if_resident(shard) as pinned:
        assert pinned is True and shard.resident and shard.buffer is not None
    loader.join(5)
    assert shard.pins == 0 and (tier.stats.hits, tier.stats.misses) == (1, 1)
    tier.close()


def test_forget_frees_a_dropped_models_arenas_and_its_queued_loads():
    tier = _tier(4)
    kept, dropped = FakeShard(0, "kept"), [FakeShard(i, "gone") for i in range(3)]
    _touch(tier, kept, dropped[0], dropped[1])
    for shard in dropped:
        shard.dropped = True
    with tier.cond:  # queued before the drop: neither the prefetch thread nor forget may load it
        tier._queue.append(dropped[2])
    assert tier.forget(dropped, timeout=5) == 2 * ARENA
    assert _resident(tier) == {0} and tier.used == ARENA and tier.pooled == 0  # returned, not pooled
    assert not tier._queue and all(s.buffer is None for s in dropped)
    try:
        _touch(tier, dropped[0])
    except LookupError:
        pass
    else:
        raise AssertionError("a dropped shard was pinned")
    tier.close()
