"""The shards this daemon holds and every operation on them: the data path (ShardStore), the
model registry, and the admin services. Knows no gRPC and no tier but their roles: imports the
model, ps_offload.daemon.tiers.tier and the contract, never ps_offload.daemon.rpc or
ps_offload.daemon.dataplane.

    shard_store       ShardStore: the data path (pull, push with (shard, step) dedup, commit), each
                      request's shard looked up and checked once (CheckedPush, CheckedPull)
    registry          ModelRegistry: register, recover, look up, drop
    shard             one shard: its arena (master, optimizer state), its version and its reader/writer hold
    push              PushRequest: one push from the wire to the optimizer, validated before anything changes
    push_kinds        what ShardStore.push runs for each kind of push, one function per kind
    accumulate        GradientParts: a shard's fp32 sum of a step's GRADIENT_PART pushes, until its APPLY
    speculation       a step computed ahead from a speculative part 0 into a spare arena, adopted or
                      discarded by its APPLY
    pull              PullRequest: one pull (tensor, shard, version, dtype), built once from the wire
    pull_rounding     bf16/fp16 pulls: master values rounded as torch's Tensor.to does
    master_pull       master pulls with NVMe: from RAM if resident, else the committed master region on disk
    residency_window  which master pulls load the whole arena and keep it until the shard's update
    pull_wait         PullWaits: pulls waiting for a version, bounded; a wait ends when its call does
    prefetch          Prefetcher: what the RAM tier loads ahead (trainer hints, the learned push order)
    persistence       the committed copy on NVMe: create, load, commit, roll back a failed update
    limits            StoreLimits: a registration's model count, plan size and RAM need, checked first
    replica_reports   what trainers of replicated models report of their lost holders (degraded shards)
    snapshot_admin    the store's snapshots: take, list, delete, read a snapshot's tensor
    inspection        value statistics, which shards to verify, verify
    stats             the store's counters and its tiers', as `ps-admin stats` shows them
    tier_admin        a shard moved between RAM and NVMe by hand (`ps-admin evict`, `prefetch`)
    drop              dropping a model: every wait on its shards ended, its sums released
"""
