"""compression_convergence: does 1-bit Adam train the demo model as well as fp32 pushes, and
how many bytes does it save?

Two runs of examples/train_gpt.py's defaults (0.81M-parameter char GPT, 300 steps, the same
seed and batches) through one local daemon: uncompressed, and `--compression onebit` with 60
uncompressed warm-up steps (a fifth of the run). Figure: final loss (mean of the last 20
steps) of 1-bit Adam over the uncompressed run's (lower is better; target <= 1.03, the issue's
"within 3%"). The bytes each pushed per step after the warm-up, as the trainer counted what the
daemon applied, go in the JSON with the loss curves.
"""

from __future__ import annotations

import sys

from bench.common import REPO, BenchDaemon, record

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

STEPS, WARMUP = 300, 60
CHECKPOINTS = (50, 100, 150, 200, 250, 300)


def _run(address: str, compression: str) -> tuple[list[float], int]:
    argv = ["--daemons", address, "--model-name", compression, "--steps", str(STEPS), "--sample", "0"]
    argv += ["--compression", compression, "--compression-warmup-steps", str(WARMUP if compression != "none" else 0)]
    args = train_gpt.parse_args(argv)
    pushed: list[int] = []
    losses = train_gpt.train(args, on_step=lambda opt: pushed.append(opt.bytes_pushed))
    return losses, pushed[-1] - pushed[-2]  # the last step's bytes (compressed for onebit)


def main() -> dict:
    with BenchDaemon() as daemon:
        exact, exact_bytes = _run(daemon.address, "none")
        onebit, onebit_bytes = _run(daemon.address, "onebit")
    final = {name: sum(losses[-20:]) / 20 for name, losses in (("none", exact), ("onebit", onebit))}
    curves = {
        name: {step: round(sum(losses[step - 20 : step]) / 20, 4) for step in CHECKPOINTS}
        for name, losses in (("none", exact), ("onebit", onebit))
    }
    for name, curve in curves.items():
        print(f"{name:>8}: " + "  ".join(f"{step}:{loss:.3f}" for step, loss in curve.items()))
    return record(
        "compression_convergence",
        ours=final["onebit"],
        peer=final["none"],
        unit="final loss",
        target=1.03,
        higher_is_better=False,
        notes=f"demo char GPT, {STEPS} steps, one local daemon; 1-bit Adam after {WARMUP} plain steps vs fp32 "
        f"pushes; loss = mean of the last 20 steps; bytes per step: fp32 {exact_bytes}, onebit {onebit_bytes} "
        f"({exact_bytes / onebit_bytes:.1f}x fewer)",
        extra={"curves": curves, "bytes_per_step": {"none": exact_bytes, "onebit": onebit_bytes}},
    )


if __name__ == "__main__":
    main()
