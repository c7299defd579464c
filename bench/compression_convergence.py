"""compression_convergence: does 1-bit Adam train the demo model as well as fp32 pushes, and
how many bytes does it save?

For each of 3 seeds (model initialisation and batches), two runs of examples/train_gpt.py's
defaults (0.81M-parameter char GPT, 300 steps) through one local daemon: uncompressed, and
`--compression onebit` with 60 uncompressed warm-up steps (a fifth of the run). Per seed:
final loss (mean of the last 20 steps) of 1-bit Adam over the uncompressed run's. Figure: the
mean of the per-seed ratios, with their min and max (lower is better; target <= 1.03, the
issue's "within 3%"). The bytes each pushed per step after the warm-up, as the trainer counted
what the daemon applied, go in the JSON with the per-seed finals and the mean loss curves.
"""

from __future__ import annotations

import statistics
import sys

from bench.common import REPO, BenchDaemon, quick, record, spread

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

STEPS, WARMUP = quick(300, 24), quick(60, 8)
SEEDS = quick((0, 1, 2), (0, 1))
CHECKPOINTS = tuple(STEPS * k // 6 for k in range(1, 7))  # 50, 100, ... 300


def _run(address: str, compression: str, seed: int) -> tuple[list[float], int]:
    # A model name per run: registering a name again would resume from the daemon's state.
    argv = ["--daemons", address, "--model-name", f"{compression}.seed{seed}", "--seed", str(seed)]
    argv += ["--steps", str(STEPS), "--sample", "0"]
    argv += ["--compression", compression, "--compression-warmup-steps", str(WARMUP if compression != "none" else 0)]
    args = train_gpt.parse_args(argv)
    pushed: list[int] = []
    losses = train_gpt.train(args, on_step=lambda opt: pushed.append(opt.bytes_pushed))
    return losses, pushed[-1] - pushed[-2]  # the last step's bytes (compressed for onebit)


def _final(losses: list[float]) -> float:
    """Mean of the last 20 losses (one step's loss is noisy)."""
    return statistics.mean(losses[-20:])


def main() -> dict:
    runs: dict[str, list[list[float]]] = {"none": [], "onebit": []}
    step_bytes = {}
    with BenchDaemon() as daemon:
        for seed in SEEDS:
            for compression in runs:
                losses, step_bytes[compression] = _run(daemon.address, compression, seed)
                runs[compression].append(losses)
    finals = {name: [_final(losses) for losses in seeds] for name, seeds in runs.items()}
    ratios = [o / n for o, n in zip(finals["onebit"], finals["none"], strict=True)]
    curves = {
        name: {step: round(statistics.mean(_final(losses[:step]) for losses in seeds), 4) for step in CHECKPOINTS}
        for name, seeds in runs.items()
    }
    for name, curve in curves.items():
        print(f"{name:>8}: " + "  ".join(f"{step}:{loss:.3f}" for step, loss in curve.items()))
    exact_bytes, onebit_bytes = step_bytes["none"], step_bytes["onebit"]
    return record(
        "compression_convergence",
        ours=statistics.mean(finals["onebit"]),
        peer=statistics.mean(finals["none"]),
        ratio=statistics.mean(ratios),
        unit="final loss",
        target=1.03,
        higher_is_better=False,
        notes=f"demo char GPT, {STEPS} steps, one local daemon, seeds {', '.join(map(str, SEEDS))}; 1-bit Adam "
        f"after {WARMUP} plain steps vs fp32 pushes; loss = mean of the last 20 steps; ours, peer: mean over "
        f"seeds; ratio: mean of the per-seed ratios; bytes per step: fp32 {exact_bytes}, onebit {onebit_bytes} "
        f"({exact_bytes / onebit_bytes:.1f}x fewer)",
        extra={
            "seeds": list(SEEDS),
            "final_loss_per_seed": {name: [round(f, 4) for f in fs] for name, fs in finals.items()},
            "ratio_per_seed": [round(r, 4) for r in ratios],
            "ratio_spread": spread(ratios),
            "curves_mean_over_seeds": curves,
            "bytes_per_step": {"none": exact_bytes, "onebit": onebit_bytes},
            "bytes_ratio": round(exact_bytes / onebit_bytes, 1),
        },
    )


if __name__ == "__main__":
    main()
