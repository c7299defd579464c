"""Where a shard's bytes live: the RAM tier over NVMe arena files and their commit protocol, or,
without store.nvme_dir, RAM alone. The tiers import neither the store nor the model (they keep
bytes and JSON, whatever the spec says); of the rest of the daemon, only ps_offload.daemon.errors.

    tier                all the store sees of the tiers: the three roles (ResidencyTier, ShardFiles,
                        SumStore) and Tiers, their errors, page-aligned memory
    ram                 the RAM tier over NVMe: budget, pinning, eviction by upcoming order then LRU,
                        pooled arenas, prefetch
    ram_only            the tiers of a daemon without store.nvme_dir: every shard resident, nothing at rest
    nvme                shards at rest: one arena file per model, O_DIRECT, crc32c-checked; commit, load,
                        recovery
    model_file          one model's arena file: its layout, which slot holds each shard, free and pinned slots
    slot_header         the 4 KiB slot header: formats 2 and 3, crc32c of the arena and of its master region
    version_floors      each shard's committed version recorded beside the arena: a damaged header is DATA_LOSS
    snapshot_pins       SnapshotBook: a model's snapshots as pinned slots, checked at recovery
    direct_io           the O_DIRECT engine: aligned buffers, block-split reads and writes, injected errors
    commit_group        CommitGroups: the commits queued while one group is written go to disk together,
                        two flushes per group
    group_sync          GroupSync: flushes requested at once share one fdatasync
    accumulator_files   AccumulatorFiles: the sums of steps pushed in parts, as unlinked files on NVMe
    crash_points        testing aid: SIGKILL at a chosen point of the commit protocol (PS_OFFLOAD_CRASH_AT)
"""
