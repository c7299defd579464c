"""staleness_convergence: does the delayed parameter update (`--staleness 1`) converge like
the exact update on the demo model, and what does it save per step?

For each of 3 seeds (model initialisation and batches), runs of examples/train_gpt.py's
defaults (0.81M-parameter char GPT, 300 steps) through a local daemon with staleness 0 (the
exact update) and with staleness 1; for the first seed also in-process fused AdamW (which the
exact update equals bit for bit, so it is run once, for its step time). Per seed: final loss
(mean of the last 20 steps) with staleness 1 over the exact update's. Figure: the mean of the
per-seed ratios, with their min and max (lower is better; target <= 1.05, i.e. at most 5%
worse). The step times go in the JSON: the delayed update's use is to take the optimizer off
the critical path.
"""

from __future__ import annotations

import statistics
import sys
import time

from bench.common import REPO, BenchDaemon, quick, record, spread

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

STEPS = quick(300, 24)
SEEDS = quick((0, 1, 2), (0, 1))
CHECKPOINTS = tuple(sorted({min(25, STEPS), *(STEPS * k // 6 for k in range(1, 7))}))  # 25, 50, 100, ... 300


def _run(argv: list[str]) -> tuple[list[float], float]:
    args = train_gpt.parse_args([*argv, "--steps", str(STEPS), "--sample", "0"])
    started = time.perf_counter()
    losses = train_gpt.train(args)
    return losses, 1000 * (time.perf_counter() - started) / STEPS


def _curve(runs: list[list[float]]) -> dict[int, float]:
    """Mean loss over the 20 steps up to each checkpoint (one step's loss is noisy), averaged
    over the runs (seeds)."""
    return {
        step: round(statistics.mean(statistics.mean(losses[max(0, step - 20) : step]) for losses in runs), 4)
        for step in CHECKPOINTS
    }


def main() -> dict:
    runs: dict[str, list[list[float]]] = {"staleness 0": [], "staleness 1": []}
    ms: dict[str, list[float]] = {"staleness 0": [], "staleness 1": []}
    with BenchDaemon() as daemon:
        for seed in SEEDS:
            # A model name per run: registering a name again would resume from the daemon's state.
            common = ["--daemons", daemon.address, "--seed", str(seed)]
            variants = {
                "staleness 0": ["--model-name", f"exact.seed{seed}"],
                "staleness 1": ["--model-name", f"delayed.seed{seed}", "--staleness", "1"],
            }
            for name, flags in variants.items():
                losses, step_ms = _run([*common, *flags])
                runs[name].append(losses)
                ms[name].append(step_ms)
    local, local_ms = _run(["--local", "--seed", str(SEEDS[0])])
    finals = {name: [sum(losses[-20:]) / 20 for losses in seeds] for name, seeds in runs.items()}
    ratios = [d / e for d, e in zip(finals["staleness 1"], finals["staleness 0"], strict=True)]
    curves = {name: _curve(seeds) for name, seeds in runs.items()}
    curves[f"in-process (seed {SEEDS[0]})"] = _curve([local])
    for name, curve in curves.items():
        print(f"{name:>20}: " + "  ".join(f"{step}:{loss:.3f}" for step, loss in curve.items()))
    ms_per_step = {name: round(statistics.median(v), 1) for name, v in ms.items()}
    ms_per_step["in-process"] = round(local_ms, 1)
    return record(
        "staleness_convergence",
        ours=statistics.mean(finals["staleness 1"]),
        peer=statistics.mean(finals["staleness 0"]),
        ratio=statistics.mean(ratios),
        unit="final loss",
        target=1.05,
        higher_is_better=False,
        notes=f"demo char GPT, {STEPS} steps, one local daemon, seeds {', '.join(map(str, SEEDS))}; loss = mean of "
        "the last 20 steps; ours, peer: mean over seeds; ratio: mean of the per-seed ratios; ms/step (median over "
        f"seeds) staleness 1 {ms_per_step['staleness 1']}, staleness 0 {ms_per_step['staleness 0']}, in-process "
        f"{ms_per_step['in-process']}",
        extra={
            "seeds": list(SEEDS),
            "final_loss_per_seed": {name: [round(f, 4) for f in fs] for name, fs in finals.items()},
            "in_process_final_loss": round(sum(local[-20:]) / 20, 4),
            "ratio_per_seed": [round(r, 4) for r in ratios],
            "ratio_spread": spread(ratios),
            "curves_mean_over_seeds": curves,
            "ms_per_step": ms_per_step,
        },
    )


if __name__ == "__main__":
    main()
