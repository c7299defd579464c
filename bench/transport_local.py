"""transport_local: a 256 MiB model (64M fp32 in four 64 MiB shards) pulled and pushed through
the node's own daemon over the local shared-memory transport (ShardedClient on the daemon's
local endpoint, `streams_per_daemon` connections and as many threads, as OffloadOptimizer
uses), against the physical bound: one in-process torch `copy_` of the same 256 MiB (as many
threads as torch gives it).

The trainer's buffer is a window shared with the daemon (Transports.shared_host_tensor, as
OffloadOptimizer's flat buffers are): a pull is one copy, by the daemon under the shard's read
hold, straight into it; a push (PARAMETERS: no optimizer step) one copy, by the daemon, from
it into the master values. So each moves the bytes once, as the bound does; what the ratio
measures is the round trips and the threads. The same buffers outside a window (`*_slot`:
through each connection's slot, one more copy on the trainer's side) are measured in the same
rounds. Target >= 0.8.

Rounds run interleaved (pull, push, copy_, and the slot's pull and push; then reversed), and
each figure is the median of the per-round ratios (the copy's time over ours: the throughput
ratio), with their spread. The headline is the lower of the pull and the push ratio; all are
in the result file.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from bench.common import BenchDaemon, interleaved_many, median, quick, record, spread
from bench.transport import shard_movers
from ps_offload.proto import ps_pb2
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.local_client import LocalClient
from ps_offload.trainer.wire.sharded_client import ShardedClient

NBYTES = quick(256 << 20, 16 << 20)
NUMEL = NBYTES // 4
PIECE = quick(64 << 20, 4 << 20)  # the shard size: each request moves one shard
REPS = quick(10, 3)


def main() -> dict:
    config = ClientConfig(transport="local")  # the local transport on the daemon's own host
    with BenchDaemon() as daemon:
        client = ShardedClient([daemon.address], config=config)
        spec = ps_pb2.ModelSpec(
            model="transport-local",
            params=[ps_pb2.ParamSpec(name="w", shape=[NUMEL], dtype=ps_pb2.FLOAT32)],
            optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.1)),
            shard_bytes=PIECE,
        )
        plan = client.register(spec)
        if not isinstance(client.transports[0], LocalClient):
            raise RuntimeError(f"the local transport was not used ({type(client.transports[0]).__name__})")
        source, target = torch.randn(NUMEL), torch.empty(NUMEL)  # the bound's own bytes
        pool = ThreadPoolExecutor(max_workers=config.streams_per_daemon)
        shared = client.transports.shared_host_tensor(NUMEL, torch.float32)
        if shared is None:
            raise RuntimeError("the daemon did not take the window (server.local_pool_bytes)")
        push_all, pull_all = shard_movers(client, plan, pool, flat=shared)
        push_slot, pull_slot = shard_movers(client, plan, pool)
        times = interleaved_many(
            {
                "pull": pull_all,
                "push": push_all,
                "copy": lambda: target.copy_(source),
                "pull_slot": pull_slot,
                "push_slot": push_slot,
            },
            reps=REPS,
            warmup=2,
        )
        pool.shutdown()
        client.close()

    gbps = {who: NBYTES / median(ts) / 1e9 for who, ts in times.items()}
    kinds = ("pull", "push", "pull_slot", "push_slot")
    vs = {kind: [c / o for o, c in zip(times[kind], times["copy"], strict=True)] for kind in kinds}
    ratios = {kind: median(v) for kind, v in vs.items()}
    head = min(("pull", "push"), key=ratios.get)
    return record(
        "transport_local",
        ours=gbps[head],
        peer=gbps["copy"],
        ratio=ratios[head],
        unit="GB/s",
        target=0.8,
        higher_is_better=True,
        notes=f"{NBYTES >> 20} MiB in shards of {PIECE >> 20} MiB through the node's daemon over the local "
        f"shared-memory transport into and out of a window shared with it (the *_slot figures: through the "
        f"slots, one more copy), {config.streams_per_daemon} connections and threads; peer: one in-process "
        f"torch copy_ of the same bytes (the physical bound); headline: the {head} (the lower of pull and push); "
        f"{REPS} rounds interleaved, ratio = median of the per-round ratios",
        extra={
            "connections": config.streams_per_daemon,
            "ratio_spread": spread(vs[head]),
            "pull_gbps": round(gbps["pull"], 3),
            "push_gbps": round(gbps["push"], 3),
            "copy_gbps": round(gbps["copy"], 3),
            "ratio_pull": round(ratios["pull"], 3),
            "ratio_pull_spread": spread(vs["pull"]),
            "ratio_push": round(ratios["push"], 3),
            "ratio_push_spread": spread(vs["push"]),
            "pull_slot_gbps": round(gbps["pull_slot"], 3),
            "push_slot_gbps": round(gbps["push_slot"], 3),
            "ratio_pull_slot": round(ratios["pull_slot"], 3),
            "ratio_push_slot": round(ratios["push_slot"], 3),
        },
    )


if __name__ == "__main__":
    main()
