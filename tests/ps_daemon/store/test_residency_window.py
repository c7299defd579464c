"""The residency window, in the store on real files: in a streamed step (every shard pulled in
forward order, then pulled and updated in reverse), the shards a backward updates first are
loaded whole at their forward pull and kept until their update, the rest read their master
region at the forward pull and their arena once for the backward pull and update together;
the values are those of a store that holds everything in RAM, bit for bit."""

from __future__ import annotations

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.store import tier_admin
from ps_offload.daemon.store.pull import PullRequest
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.residency_window import WindowPlan, plan_window, updates_at_once
from ps_offload.daemon.store.shard import arena_nbytes
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.daemon.tiers.nvme import PAGE, DirectIO, NvmeFiles
from ps_offload.optimizers import AdamW
from tests.helpers.specs import register_in_store

NUMEL = 1024  # one page of master values per shard
SHARDS = 16
DEPTH = 2
ARENA = arena_nbytes(NUMEL, AdamW())


def _store(directory, *, ram_shards: int) -> ShardStore:
    files = None
    if directory is not None:
        files = NvmeFiles(directory, io=DirectIO(threads=2, block_bytes=PAGE), fsync=False, spare_slots=2)
    ram = ram_shards * ARENA if files is not None else 1 << 30
    return open_store(ram_bytes=ram, default_shard_bytes=NUMEL * 4, files=files, prefetch_depth=DEPTH)


def _register(store: ShardStore) -> None:
    register_in_store(store, shards=SHARDS, numel=NUMEL)


def _pull(store: ShardStore, shard_id: int, step: int) -> torch.Tensor:
    with store.pull(PullRequest("m", shard_id, min_version=step), timeout=30) as (values, version):
        assert version == step
        return values.clone()


def _forward(store: ShardStore, step: int) -> list[torch.Tensor]:
    return [_pull(store, shard_id, step) for shard_id in range(SHARDS)]


def _backward(store: ShardStore, step: int, block: int, *, racing: bool = False) -> list[torch.Tensor]:
    """From the last, each block of `block` shards pulled again, then its shards updated: with
    _forward, what a streamed trainer asks of its daemon in a step. Returns the values pulled.
    `racing`: as a trainer that prefetches, the next block is pulled before this one's pushes,
    and a block's shards in the order that is the race's worst case (the one updated last
    first, before its sibling's pull reaches the tier)."""
    order = list(reversed(range(SHARDS)))
    blocks = [order[at : at + block] for at in range(0, SHARDS, block)]

    def pull_block(shard_ids: list[int]) -> list[torch.Tensor]:
        return [_pull(store, shard_id, step) for shard_id in (reversed(shard_ids) if racing else shard_ids)]

    pulled = pull_block(blocks[0])
    for at, shard_ids in enumerate(blocks):
        following = blocks[at + 1] if at + 1 < len(blocks) else []
        if racing:
            pulled += pull_block(following)
        for shard_id in shard_ids:
            gradient = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * shard_id + step))
            store.push(PushRequest("m", shard_id, step=step, kind="gradient", data=gradient, lr=None))
        if not racing:
            pulled += pull_block(following)
    return pulled


def _close(store: ShardStore) -> None:
    store.close()
    if store.files is not None:
        store.files.close()


def _load_bytes(store: ShardStore) -> int:
    """What loading one shard whole reads."""
    tier_admin.evict(store, "m", 0)
    before = store.stats_snapshot().nvme_bytes_read
    tier_admin.load(store, "m", 0)
    return store.stats_snapshot().nvme_bytes_read - before


@pytest.mark.parametrize(
    ("ram_shards", "window_shards", "forward_loads", "block", "racing"),
    # The forward loads the window's shards whole, and the shards the next DEPTH + 1 updates
    # take where the tier holds them (the prefetch's room).
    [(6, 3, 3, 1, False), (4, 1, 3, 1, False), (2, 1, 2, 1, False), (6, 3, 3, 2, False), (4, 1, 3, 2, False)]
    # Racing pulls are read once where the window holds the blocks being updated; past it, a
    # sibling that asks first reads its master region (a looser rule read more bytes per step
    # in zero_infinity_small: docs/benchmarks.md).
    + [(6, 3, 3, 2, True)],
)
def test_a_streamed_step_loads_each_arena_once_and_the_window_keeps_the_last_ones(
    tmp_path, ram_shards, window_shards, forward_loads, block, racing
):
    store, reference = _store(tmp_path, ram_shards=ram_shards), _store(None, ram_shards=0)
    try:
        for s in (store, reference):
            _register(s)
        assert store.window.plan("m").shards == window_shards  # ram_shards less DEPTH + 1
        load_bytes = _load_bytes(store)
        for step in range(4):
            start = store.stats_snapshot()
            pulled, expected = _forward(store, step), _forward(reference, step)
            middle = store.stats_snapshot()
            pulled += _backward(store, step, block, racing=racing)
            expected += _backward(reference, step, block, racing=racing)
            end = store.stats_snapshot()
            for a, b in zip(pulled, expected, strict=True):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), step
            if step < 1:
                continue  # the first step learns the order
            # Forward: the window's shards (the last pulled) are loaded whole; the others read
            # their master region, unless the previous step left them in RAM.
            assert middle.window_loads - start.window_loads == forward_loads, step
            # Backward: no master region is read (a block's shards after the first are loaded
            # whole once the first is in RAM); the whole step reads no arena twice.
            assert end.nvme_master_reads == middle.nvme_master_reads, step
            loads = end.tier_misses + end.prefetched - start.tier_misses - start.prefetched
            master_reads = end.nvme_master_reads - start.nvme_master_reads
            assert loads <= SHARDS, step
            assert end.nvme_bytes_read - start.nvme_bytes_read == loads * load_bytes + master_reads * PAGE, step
    finally:
        _close(store)
        _close(reference)


def test_without_a_learned_order_every_master_pull_reads_the_master_only(tmp_path):
    store = _store(tmp_path, ram_shards=6)
    try:
        _register(store)
        for shard_id in range(SHARDS):
            tier_admin.evict(store, "m", shard_id)
        before = store.stats_snapshot()
        for shard_id in range(SHARDS):
            _pull(store, shard_id, 0)
        after = store.stats_snapshot()
        assert after.window_loads == 0 and after.tier_misses == before.tier_misses
        assert after.nvme_master_reads == before.nvme_master_reads + SHARDS
    finally:
        _close(store)


def test_the_window_plan_counts_what_the_tier_keeps_besides_it():
    arena = 100
    assert plan_window(10 * arena, [arena] * 20, depth=2, models=1).shards == 7  # 10 less 3
    assert plan_window(10 * arena, [arena] * 20, depth=2, models=2).shards == 3  # shared
    assert plan_window(10 * arena, [arena] * 4, depth=2, models=1).shards == 4  # the whole model
    # The shard updated next is held in the room kept for the update in flight.
    assert plan_window(3 * arena, [arena] * 20, depth=2, models=1) == WindowPlan(0, 1)
    assert plan_window(10 * arena, [], depth=2, models=1).shards == 0


def test_updates_side_by_side_take_only_room_the_window_does_not_plan_on():
    arena = 100
    # A tier smaller than the model: one update in flight, the one the window keeps room for.
    assert updates_at_once(10 * arena, [arena] * 20, depth=2, models=1, most=8) == 1
    # The model whole (4), the prefetch (2) and the update in flight (1) take 7 of 10: 3 more.
    assert updates_at_once(10 * arena, [arena] * 4, depth=2, models=1, most=8) == 4
    assert updates_at_once(10 * arena, [arena] * 4, depth=2, models=1, most=2) == 2  # the spare slots
    assert updates_at_once(10 * arena, [arena] * 4, depth=2, models=2, most=8) == 1  # a half each
    assert updates_at_once(10 * arena, [arena] * 4, depth=2, models=1, most=1) == 1  # no NVMe
    assert updates_at_once(10 * arena, [], depth=2, models=1, most=8) == 1  # not registered here


def _jittered(order: list[int], step: int) -> list[int]:
    """`order` with neighbours swapped, pairs chosen by the step's parity: how a trainer's
    concurrent pushes arrive, each step a little differently from the last."""
    jittered = list(order)
    for at in range(step % 2, len(jittered) - 1, 2):
        jittered[at], jittered[at + 1] = jittered[at + 1], jittered[at]
    return jittered


@pytest.mark.parametrize("ram_shards", [6, 4])
def test_a_push_order_that_differs_from_the_last_steps_loads_each_arena_once(tmp_path, ram_shards):
    """The learned order is last step's; this step's pushes come in another order. A shard
    already pushed this step is not read ahead again for its place in last step's order, and
    one whose place has passed but whose push has not come yet stays upcoming (not evicted
    first, to be read again at its push): every arena is read once a step, and every push
    finds its shard in RAM."""
    store = _store(tmp_path, ram_shards=ram_shards)
    try:
        _register(store)
        load_bytes = _load_bytes(store)
        for step in range(5):
            start = store.stats_snapshot()
            _forward(store, step)
            middle = store.stats_snapshot()
            for shard_id in _jittered(list(reversed(range(SHARDS))), step):
                _pull(store, shard_id, step)
                gradient = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * shard_id + step))
                store.push(PushRequest("m", shard_id, step=step, kind="gradient", data=gradient, lr=None))
            end = store.stats_snapshot()
            if step < 1:
                continue  # the first step learns the order
            loads = end.tier_misses + end.prefetched - start.tier_misses - start.prefetched
            master_reads = end.nvme_master_reads - start.nvme_master_reads
            assert loads <= SHARDS, step
            assert end.nvme_bytes_read - start.nvme_bytes_read == loads * load_bytes + master_reads * PAGE, step
            # The backward's pulls came after the prefetch of their shards: none waits on a
            # master read, and no push loads its arena again.
            assert end.nvme_master_reads == middle.nvme_master_reads, step
    finally:
        _close(store)
