"""The results as one chart (docs/benchmarks.svg, shown in README.md and docs/benchmarks.md):
each figure's ratio as a fraction of its target, so that 1 is the target for every figure
whichever way it points (ratio / target where higher is better, target / ratio where lower
is), with its paired spread as a whisker. Green: met; red: not. Rendered by `make bench`
(bench/run_all.update_doc) from bench/results/*.json; SVG, so the committed file is text."""

from __future__ import annotations

from pathlib import Path


def of_target(value: float, r: dict) -> float:
    """`value` (a ratio) as a fraction of the figure's target: >= 1 is met."""
    return value / r["target"] if r["higher_is_better"] else r["target"] / value


def render(results: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "ps-offload"  # the same ids for the same chart: small diffs
    plt.rcParams["svg.fonttype"] = "none"  # text as text: a smaller file, and greppable
    rows = sorted(results.values(), key=lambda r: of_target(r["ratio"], r))
    names = [r["name"] for r in rows]
    values = [of_target(r["ratio"], r) for r in rows]
    low, high = [], []
    for r, v in zip(rows, values, strict=True):
        spread = r.get("ratio_spread")
        ends = sorted(of_target(x, r) for x in (spread["min"], spread["max"])) if spread else [v, v]
        low.append(max(v - ends[0], 0.0))
        high.append(max(ends[1] - v, 0.0))
    figure, axes = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.2))
    colors = ["#2e7d32" if r["target_met"] else "#c62828" for r in rows]
    axes.barh(names, values, xerr=[low, high], color=colors, error_kw={"elinewidth": 0.8, "capsize": 2})
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.set_xlabel("ratio as a fraction of its target (1 = target; right of it: met)")
    axes.set_xlim(0, min(max(v + h for v, h in zip(values, high, strict=True)) * 1.05, 3.0))
    axes.tick_params(axis="y", labelsize=7)
    axes.set_title("ps-offload against its peers: every figure of bench/results, with its paired spread", fontsize=9)
    figure.tight_layout()
    figure.savefig(out, format="svg", metadata={"Date": None})
    plt.close(figure)
