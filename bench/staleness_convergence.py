"""staleness_convergence: does the delayed parameter update (`--staleness 1`) converge like
the exact update on the demo model, and what does it save per step?

Three runs of examples/train_gpt.py's defaults (0.81M-parameter char GPT, 300 steps, the
same seed and batches): through a local daemon with staleness 0 (the exact update), through
it with staleness 1, and in-process fused AdamW. Figure: final loss (mean of the last 20
steps) with staleness 1 over the exact update's (lower is better; target <= 1.05, i.e. at
most 5% worse). The step times go in the JSON: the delayed update's use is to take the
optimizer off the critical path.
"""

from __future__ import annotations

import sys
import time

from bench.common import REPO, BenchDaemon, record

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

STEPS = 300
CHECKPOINTS = (25, 50, 100, 150, 200, 250, 300)


def _run(argv: list[str]) -> tuple[list[float], float]:
    args = train_gpt.parse_args([*argv, "--steps", str(STEPS), "--sample", "0"])
    started = time.perf_counter()
    losses = train_gpt.train(args)
    return losses, 1000 * (time.perf_counter() - started) / STEPS


def _curve(losses: list[float]) -> dict[int, float]:
    """Mean loss over the 20 steps up to each checkpoint (one step's loss is noisy)."""
    return {step: round(sum(losses[step - 20 : step]) / 20, 4) for step in CHECKPOINTS}


def main() -> dict:
    with BenchDaemon() as daemon:
        exact, exact_ms = _run(["--daemons", daemon.address, "--model-name", "exact"])
        delayed, delayed_ms = _run(["--daemons", daemon.address, "--model-name", "delayed", "--staleness", "1"])
    local, local_ms = _run(["--local"])
    curves = {"staleness 0": _curve(exact), "staleness 1": _curve(delayed), "in-process": _curve(local)}
    for name, curve in curves.items():
        print(f"{name:>12}: " + "  ".join(f"{step}:{loss:.3f}" for step, loss in curve.items()))
    return record(
        "staleness_convergence",
        ours=curves["staleness 1"][STEPS],
        peer=curves["staleness 0"][STEPS],
        unit="final loss",
        target=1.05,
        higher_is_better=False,
        notes=f"demo char GPT, {STEPS} steps, one local daemon; loss = mean of the last 20 steps; ms/step "
        f"staleness 1 {delayed_ms:.1f}, staleness 0 {exact_ms:.1f}, in-process {local_ms:.1f}",
        extra={
            "curves": curves,
            "ms_per_step": {"staleness 1": delayed_ms, "staleness 0": exact_ms, "in-process": local_ms},
        },
    )


if __name__ == "__main__":
    main()
