"""The store's counters, as ps-admin stats shows them: its own (pulls, pushes, the optimizer's
time) and its tiers' (ps_offload.daemon.tiers.tier: RAM residency, NVMe reads and writes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ps_offload.daemon.store.shard import Shard
from ps_offload.daemon.tiers.tier import ResidencyTier, ShardFiles


@dataclass
class StoreStats:
    bytes_pulled: int = 0
    bytes_pushed: int = 0
    pulls: int = 0
    pulls_carried: int = 0  # of `pulls`, those a push carried (DataRequest.pull_into)
    pushes_applied: int = 0
    pushes_duplicate: int = 0
    optimizer_seconds: float = 0.0
    prefetch_hints: int = 0
    window_loads: int = 0  # master pulls that loaded the whole arena (ps_offload.daemon.store.residency_window)
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class StatsSnapshot:
    models: int
    shards: int
    ram_bytes_used: int
    bytes_pulled: int
    bytes_pushed: int
    pulls: int
    pulls_carried: int
    pushes_applied: int
    pushes_duplicate: int
    optimizer_seconds: float
    prefetch_hints: int
    window_loads: int
    uptime_seconds: float
    tier_hits: int
    tier_misses: int
    prefetched: int
    evictions: int
    nvme_bytes_read: int
    nvme_bytes_written: int
    nvme_read_seconds: float
    nvme_write_seconds: float
    nvme_master_reads: int
    nvme_master_bytes_read: int
    nvme_commits: int
    nvme_commit_groups: int
    nvme_flushes: int
    nvme_flush_seconds: float
    ram_bytes_budget: int
    nvme_bytes_allocated: int
    nvme_bytes_capacity: int
    shards_in_ram: int
    shards_on_nvme: int
    shards_corrupt: int
    speculative_steps: int = 0  # steps computed during backward and adopted by their APPLY
    speculative_redone: int = 0  # of those computed, the ones discarded (the APPLY named other settings)
    speculation_bytes: int = 0  # spare arenas held (store.speculation_bytes bounds them)


def tier_counts(files: ShardFiles, tier: ResidencyTier, ram_bytes: int, shards: list[Shard]) -> dict:
    """The tier fields of StatsSnapshot (0 for the NVMe ones on a RAM-only daemon)."""
    tiers = [shard.tier for shard in shards]
    t = tier.counters()
    return dict(
        ram_bytes_budget=ram_bytes,
        shards_in_ram=tiers.count("ram"),
        shards_on_nvme=tiers.count("nvme"),
        shards_corrupt=tiers.count("corrupt"),
        nvme_bytes_allocated=files.bytes_allocated,
        nvme_bytes_capacity=files.capacity,
        nvme_bytes_read=files.bytes_read,
        nvme_bytes_written=files.bytes_written,
        nvme_read_seconds=files.read_seconds,
        nvme_write_seconds=files.write_seconds,
        nvme_master_reads=files.master_reads,
        nvme_master_bytes_read=files.master_bytes_read,
        nvme_commits=files.commits,
        nvme_commit_groups=files.commit_groups,
        nvme_flushes=files.flushes,
        nvme_flush_seconds=files.flush_seconds,
        tier_hits=t.hits,
        tier_misses=t.misses,
        prefetched=t.prefetched,
        evictions=t.evictions,
    )
