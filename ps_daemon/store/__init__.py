"""The shards this daemon holds and every operation on them: ShardStore (registration,
recovery, lookup, the data path: shard_store), one shard and its hold (shard), one push
and its validation (push, accumulate), the pull paths (pull_rounding, master_pull,
pull_wait), what the RAM tier loads ahead (prefetch), the committed copy on NVMe
(persistence), and the admin services (snapshot_admin, inspection, drop, limits).
Knows no gRPC: imports the model, the tiers and the contract, never ps_offload.daemon.rpc
or ps_offload.daemon.dataplane.
"""
