"""A shard moved between the RAM tier and NVMe by hand (ps-admin evict and load; Admin.Evict,
Admin.Load). The tier itself decides the rest of the time (ps_offload.daemon.tiers.ram)."""

from __future__ import annotations

from ps_offload.daemon.errors import FailedPrecondition
from ps_offload.daemon.store.shard import Shard
from ps_offload.daemon.store.shard_store import ShardStore


def evict(store: ShardStore, model: str, shard_id: int) -> Shard:
    """Drops a shard from RAM; it stays committed on disk (FailedPrecondition RAM only)."""
    shard = store.registry.shard(model, shard_id)
    if not store.tier.evict(shard):
        raise FailedPrecondition(f"shard {shard_id} of model {model!r} is in use; try again")
    return shard


def load(store: ShardStore, model: str, shard_id: int) -> Shard:
    """Reads a shard into RAM now (it stays until evicted by need or by `evict`)."""
    shard = store.registry.shard(model, shard_id)
    with store.tier.use(shard):
        return shard
