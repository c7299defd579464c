"""transport_local: a 256 MiB model (64M fp32 in four 64 MiB shards) pulled and pushed through
the node's own daemon over the local shared-memory transport (ShardedClient on the daemon's
local endpoint, `streams_per_daemon` connections, each with its slot, and as many threads, as
OffloadOptimizer uses), against the physical bound: one in-process torch `copy_` of the same
256 MiB (as many threads as torch gives it).

Each pull is a copy under the shard's read hold into the slot by the daemon, then one out of
the slot by the trainer; each push a copy into the slot, then one into the daemon's staging
buffer and one into the master values (a PARAMETERS push: no optimizer step). So the bound
is not a target this first step can reach on pulls (two copies) or pushes (three): the ratio
says how far the remaining copies and the round trips are from it. Target >= 0.8.

Rounds run interleaved (pull, push, copy_; then reversed), and each figure is the median of the
per-round ratios (the copy's time over ours: the throughput ratio), with their spread. The
headline is the lower of the pull and the push ratio; both are in the result file.
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
        push_all, pull_all = shard_movers(client, plan, pool)
        times = interleaved_many(
            {"pull": pull_all, "push": push_all, "copy": lambda: target.copy_(source)}, reps=REPS, warmup=2
        )
        pool.shutdown()
        client.close()

    gbps = {who: NBYTES / median(ts) / 1e9 for who, ts in times.items()}
    vs = {kind: [c / o for o, c in zip(times[kind], times["copy"], strict=True)] for kind in ("pull", "push")}
    ratios = {kind: median(v) for kind, v in vs.items()}
    head = min(ratios, key=ratios.get)
    return record(
        "transport_local",
        ours=gbps[head],
        peer=gbps["copy"],
        ratio=ratios[head],
        unit="GB/s",
        target=0.8,
        higher_is_better=True,
        notes=f"{NBYTES >> 20} MiB in shards of {PIECE >> 20} MiB through the node's daemon over the local "
        f"shared-memory transport, {config.streams_per_daemon} connections and threads; peer: one in-process "
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
        },
    )


if __name__ == "__main__":
    main()
