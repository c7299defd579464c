"""ps_overhead_pp_dp: the step time of a pp = 2 x dp = 2 run (four gloo processes under
torchrun, one torch thread each) with AdamW on two local ps-daemons vs the same run with
torch's fused AdamW in-process (PipelineTrainer without daemons), and a third variant through
the daemons with staleness=1 (the delayed update).

Model: the GPT of trainer.debug_models.gpt_layers (6 blocks, n_embd 256, 64 tokens; 4.79M
parameters, 2 MiB shards: 5 per stage), 1F1B over 4 micro-batches of 4 sequences per
replica, gradients clipped to norm 1.0. A step = PipelineTrainer.step(): the pipeline, the dp
all-reduce, the clipping and the optimizer (through the daemons: the pushes, and the pulls
the next forward waits for).

All three variants live in the same four processes (one PipelineTrainer each, each on its
own copy of the model) and take turns in blocks, ABC CBA ...: a block is one untimed lead-in
step, 5 timed steps, then synchronize(). Machine noise here comes in bursts of tens of
seconds that move a step by 30% or more, so runs in separate torchruns (one per variant)
disagreed by more than the effect; blocks of a few seconds side by side do not. A step's time
is the slowest rank's.

Ratio = the median over blocks of the daemons' block median over the in-process one of the
same round (paired, next to each other in time); lower is better, target <= 1.10. `ours` and
`peer` are the medians over all timed steps. The staleness=1 figures are in the result file.

Four ranks and two daemons share this machine's 2 cores: the trainer has no idle core to
hide the daemons' work in, so what they spend on the CPU shows up in the step.

    python -m bench.ps_overhead_pp_dp              # ~1.5 minutes; --smoke: a tiny config, nothing recorded
"""

from __future__ import annotations

import argparse
import os
import statistics

from bench.common import BenchDaemon, record
from bench.pipeline_worker import launch

PP, DP = 2, 2
TARGET = 1.10
VARIANTS = ("in_process", "daemons", "staleness1")
FULL = ["--n-layer", "6", "--n-embd", "256", "--block-size", "64", "--mb-size", "4", "--microbatches", "4",
        "--warmup", "2", "--blocks", "8", "--steps", "5", "--shard-bytes", str(2 << 20)]  # fmt: skip
SMOKE = ["--n-layer", "2", "--n-embd", "32", "--block-size", "16", "--mb-size", "2", "--microbatches", "2",
         "--warmup", "1", "--blocks", "1", "--steps", "1", "--shard-bytes", "4096"]  # fmt: skip


def run(*, smoke: bool = False) -> dict:
    with BenchDaemon() as d0, BenchDaemon() as d1:
        return launch(
            PP * DP, "overhead", "--pp", str(PP), "--dp", str(DP), "--schedule", "1f1b",
            "--variants", ",".join(VARIANTS), "--daemons", f"{d0.address},{d1.address}", *(SMOKE if smoke else FULL),
        )  # fmt: skip


def _paired(data: dict, variant: str) -> list[float]:
    blocks = data["block_median_ms"]
    return [a / b for a, b in zip(blocks[variant], blocks["in_process"], strict=True)]


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny configuration, one block of one step; records nothing")
    args = p.parse_args(argv)
    data = run(smoke=args.smoke)
    med = data["step_ms"]
    ratios = {v: statistics.median(_paired(data, v)) for v in ("daemons", "staleness1")}
    for variant in VARIANTS:
        blocks = ", ".join(f"{t:.0f}" for t in data["block_median_ms"][variant])
        print(f"{variant:<11} {med[variant]:8.1f} ms/step (block medians {blocks})")
    print(f"paired ratios vs in-process: daemons {ratios['daemons']:.3f}x, staleness=1 {ratios['staleness1']:.3f}x")
    if args.smoke:
        return None
    return record(
        "ps_overhead_pp_dp",
        ours=med["daemons"],
        peer=med["in_process"],
        ratio=ratios["daemons"],
        unit="ms/step",
        target=TARGET,
        higher_is_better=False,
        notes=f"pp={PP} x dp={DP} (4 ranks, 1 torch thread each, and 2 local daemons on {os.cpu_count()} cores) "
        f"vs in-process fused AdamW; {data['params'] / 1e6:.2f}M-param GPT, {data['shards_per_stage']} shards per "
        f"stage, 1F1B, 4 micro-batches of 4 x 64 tokens per replica, clip 1.0; ratio = median of "
        f"{data['blocks']} paired block ratios (ABC CBA blocks of {data['steps_per_block']} steps in one torchrun); "
        f"staleness=1: {med['staleness1']:.1f} ms/step, {ratios['staleness1']:.3f}x",
        extra={
            "staleness1_ms": round(med["staleness1"], 4),
            "staleness1_ratio": round(ratios["staleness1"], 3),
            "ratio_of_medians": {v: round(med[v] / med["in_process"], 3) for v in ("daemons", "staleness1")},
            "paired_ratios": {v: [round(r, 3) for r in _paired(data, v)] for v in ("daemons", "staleness1")},
            "block_median_ms": {v: [round(t, 1) for t in ts] for v, ts in data["block_median_ms"].items()},
            "params": data["params"],
            "shards_per_stage": data["shards_per_stage"],
        },
    )


if __name__ == "__main__":
    main()
