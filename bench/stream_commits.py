"""stream_commits: what durability costs a streamed trainer on the NVMe tier, with a step's
commits grouped (a local batch's pushes served side by side, ps_daemon/dataplane/batch_runs.py)
and one at a time, against the same daemon without fdatasync, interleaved in one run.

Three daemons on this host's disk, each with a RAM tier that holds the model (so a step reads
nothing from disk and writes every shard's new version: the commits are all the disk does):

* durable: the defaults (`store.fsync`, 8 spare slots): a step's APPLYs, one local batch,
  commit side by side, two fdatasyncs a group;
* in_order: `store.nvme_spare_slots = 1`, so one commit at a time, as a batch was served before
  side by side existed: two fdatasyncs a shard;
* unsynced: `store.fsync = false`, the bound: the same writes, no flush (crash safe, not power
  loss safe; not a contender).

The same streamed GPT (micro_batches=0: parts applied at step(), and micro_batches=1: each
block applied as backward pushes it) trains through each, in rounds whose order alternates.
Ratio: durable step time over unsynced (the cost of durability; target <= 1.05), median of the
per-round ratios; the in_order daemon's against the same unsynced rounds beside it. The daemons'
commits, groups, flushes and flush seconds per step say what the disk was asked for.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

from bench.common import REPO, BenchDaemon, daemon_stats, median, quick, record, spread
from bench.stream_overhead import BATCH, CONFIG, LR, SHARD_BYTES, reference_and_batches, streamed_model
from ps_offload import trainer

STEPS_PER_ROUND = quick(5, 2)
ROUNDS = quick(8, 2)
DAEMONS = {
    "durable": "",
    "in_order": "[store]\nnvme_spare_slots = 1\n",
    "unsynced": "[store]\nfsync = false\n",
}
COUNTERS = ("nvme_commits", "nvme_commit_groups", "nvme_flushes", "nvme_flush_seconds")


def _streamed(initial: dict, name: str, address: str, micro_batches: int):
    model, stream = streamed_model(initial, {"micro_batches": micro_batches})
    opt = trainer.offload(
        model, daemons=[address], optimizer=trainer.AdamW(lr=LR),
        config=trainer.OffloadConfig(model_name=name, shard_bytes=SHARD_BYTES), stream=stream,
    )  # fmt: skip
    return model, opt


def main() -> dict:
    reference, initial, batches = reference_and_batches(STEPS_PER_ROUND)
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ps-bench-commits-", dir=REPO)))
        daemons = {}
        for kind, text in DAEMONS.items():
            config = directory / f"{kind}.toml"
            config.write_text(text)
            nvme = directory / f"nvme-{kind}"  # on the work disk, as nvme_train_step's
            daemons[kind] = stack.enter_context(BenchDaemon("--config", str(config), "--nvme-dir", str(nvme)))
        runs = {
            (kind, micro): _streamed(initial, f"{kind}-{micro}", daemons[kind].address, micro)
            for micro in (0, 1)
            for kind in DAEMONS
        }
        times = {key: [] for key in runs}
        counted = {key: dict.fromkeys(COUNTERS, 0.0) for key in runs}

        def steps(key) -> float:
            model, opt = runs[key]
            before = daemon_stats(daemons[key[0]].address)
            started = time.perf_counter()
            for x, y in batches:
                _, loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            elapsed = (time.perf_counter() - started) / len(batches)
            after = daemon_stats(daemons[key[0]].address)
            for c in COUNTERS:
                counted[key][c] += getattr(after, c) - getattr(before, c)
            return elapsed

        keys = list(runs)
        for key in keys:  # warm-up (and the first forward's prefetch order)
            steps(key)
        counted = {key: dict.fromkeys(COUNTERS, 0.0) for key in runs}
        for r in range(ROUNDS):
            for key in keys if r % 2 == 0 else keys[::-1]:
                times[key].append(steps(key))
        shards = len(runs[keys[0]][1].plan)
        for _, opt in runs.values():
            opt.close()

    def paired(kind: str, micro: int) -> list[float]:
        return [a / b for a, b in zip(times[(kind, micro)], times[("unsynced", micro)], strict=True)]

    n_steps = ROUNDS * STEPS_PER_ROUND
    label = {0: "apply_at_step", 1: "apply_on_push"}
    return record(
        "stream_commits",
        ours=round(1000 * median(times[("durable", 0)]), 2),
        peer=round(1000 * median(times[("unsynced", 0)]), 2),
        unit="ms/step",
        target=1.05,
        higher_is_better=False,
        ratio=median(paired("durable", 0)),
        extra={
            "ratio_spread": spread(paired("durable", 0)),
            "ms_per_step": {f"{kind}_{label[micro]}": round(1000 * median(t), 2) for (kind, micro), t in times.items()},
            # Each against the unsynced daemon's rounds beside it: durability's cost, side by side and in order.
            "over_unsynced": {
                f"{kind}_{label[micro]}": {"ratio": round(median(r), 3), **spread(r)}
                for kind in ("durable", "in_order")
                for micro in (0, 1)
                for r in (paired(kind, micro),)
            },
            # What each daemon's disk was asked for per step.
            "per_step": {
                f"{kind}_{label[micro]}": {c: round(v / n_steps, 4 if "seconds" in c else 2) for c, v in n.items()}
                for (kind, micro), n in counted.items()
            },
            "shards": shards,
        },
        notes=f"{sum(p.numel() for p in reference.parameters()) / 1e6:.2f}M-param GPT ({CONFIG.n_layer} blocks, n_embd "
        f"{CONFIG.n_embd}), fp32, batch {BATCH} x {CONFIG.block_size}, streamed (window 2 blocks, prefetch), shards "
        f"of {SHARD_BYTES} B; three local daemons with NVMe on the work disk and the default RAM tier (the model "
        f"whole): durable (defaults), in_order (store.nvme_spare_slots = 1: a commit at a time) and unsynced "
        f"(store.fsync = false, the bound); micro_batches 0 (ratio) and 1; {ROUNDS} rounds of {STEPS_PER_ROUND} "
        f"steps, order alternating; ratio: median of per-round durable/unsynced ratios",
    )


if __name__ == "__main__":
    main()
