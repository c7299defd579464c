"""ShardStore internals that the integration tests do not see directly."""

from __future__ import annotations

import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.store.shard import ARENA_STAGGER, arena_nbytes
from ps_offload.optimizers import SGD, AdamW


def _shard(optimizer, numel=4096):
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=numel * 4)
    model, _ = store.registry.register(ModelSpec("m", (ParamSpec("w", (numel,)),), optimizer, numel * 4, ("d",)), 0)
    return store, model.shards[0]


def test_arena_holds_master_and_state_without_overlap_staggered_by_1kib():
    _, shard = _shard(AdamW())
    tensors = [shard.master, *shard.optimizer.state]
    base = shard.arena.data_ptr()
    starts = [t.data_ptr() - base for t in tensors]
    assert all(t.numel() == 4096 for t in tensors)
    assert all(b - a >= 4096 * 4 for a, b in zip(starts, starts[1:], strict=False))  # no overlap, in order
    assert [s % 4096 for s in starts] == [0, ARENA_STAGGER * 4, 2 * ARENA_STAGGER * 4]
    assert all(t.untyped_storage().data_ptr() == shard.arena.untyped_storage().data_ptr() for t in tensors)
    assert shard.resident_bytes == arena_nbytes(4096, AdamW()) == shard.arena.numel() * 4


def test_sgd_without_momentum_has_no_state():
    _, shard = _shard(SGD(lr=0.1))
    assert shard.optimizer.state == [] and shard.arena.numel() == 4096


def test_staging_buffers_sit_3kib_into_their_page():
    with StagingPool(max_bytes=0).borrow(4096) as buffer:
        base = buffer.untyped_storage().data_ptr()
        assert buffer.data_ptr() - base == 3 * 1024 and buffer.numel() == 4096


def test_state_starts_at_zero_and_ram_accounting_uses_arena_bytes():
    store, shard = _shard(AdamW())
    assert all(torch.count_nonzero(t) == 0 for t in (shard.master, *shard.optimizer.state))
    assert store.stats_snapshot().ram_bytes_used == shard.resident_bytes
