"""The composition root of the store: the one place that chooses its tiers. The store sees
only their roles (ps_offload.daemon.tiers.tier); which objects fill them is decided here, from
whether the daemon has an NVMe directory:

    with store.nvme_dir    RamTier over NvmeFiles, sums in AccumulatorFiles on the same disk
    RAM only               RamOnlyTier, NoShardFiles, RamSums

A new tier (object storage, say) is a new branch here and a class filling the roles, with no
change to the store. ps_offload.daemon.server builds the daemon's store here from its config;
tests and benchmarks call `open_store` with the same keywords.
"""

from __future__ import annotations

import functools

from ps_offload.daemon.store.limits import StoreLimits
from ps_offload.daemon.store.persistence import load_into
from ps_offload.daemon.store.shard import allocate_arena
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.daemon.tiers.accumulator_files import AccumulatorFiles
from ps_offload.daemon.tiers.nvme import NvmeFiles
from ps_offload.daemon.tiers.ram import RamTier
from ps_offload.daemon.tiers.ram_only import NoShardFiles, RamOnlyTier
from ps_offload.daemon.tiers.tier import RamSums, Tiers


def build_tiers(files: NvmeFiles | None, *, ram_bytes: int) -> Tiers:
    """The tiers over `files` (an opened nvme_dir), or RAM alone when there are none: every
    shard resident for good, nothing surviving a restart."""
    if files is None:
        return Tiers(NoShardFiles(), RamOnlyTier(), RamSums())
    residency = RamTier(
        budget=ram_bytes, allocate=allocate_arena, load=functools.partial(load_into, files),
        read_ahead_bytes=files.io.read_depth_bytes,
    )  # fmt: skip
    return Tiers(files, residency, AccumulatorFiles(files.dir))  # sums: the page cache over unlinked files


def open_store(
    *,
    ram_bytes: int,
    default_shard_bytes: int,
    files: NvmeFiles | None = None,
    prefetch_depth: int = 2,
    limits: StoreLimits | None = None,
    allow_nonfinite_pushes: bool = False,
    speculation_bytes: int = 0,
) -> ShardStore:
    """A ShardStore over the tiers `build_tiers` chooses (the other keywords: ShardStore's)."""
    return ShardStore(
        build_tiers(files, ram_bytes=ram_bytes),
        ram_bytes=ram_bytes,
        default_shard_bytes=default_shard_bytes,
        prefetch_depth=prefetch_depth,
        limits=limits,
        allow_nonfinite_pushes=allow_nonfinite_pushes,
        speculation_bytes=speculation_bytes,
    )
