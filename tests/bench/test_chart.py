"""bench/chart.py: every figure on one scale, its ratio as a fraction of its target (>= 1:
met, whichever way the figure points), rendered as an SVG naming every benchmark."""

from __future__ import annotations

from bench import chart
from bench.run_all import _results


def test_a_fraction_of_the_target_is_at_least_1_exactly_when_the_target_is_met():
    higher = {"target": 0.8, "higher_is_better": True}
    lower = {"target": 1.1, "higher_is_better": False}
    assert chart.of_target(0.9, higher) > 1 > chart.of_target(0.7, higher)
    assert chart.of_target(1.0, lower) > 1 > chart.of_target(1.2, lower)
    assert chart.of_target(0.8, higher) == chart.of_target(1.1, lower) == 1.0


def test_the_committed_results_render_with_every_benchmark_named(tmp_path):
    results = _results()
    out = tmp_path / "chart.svg"
    chart.render(results, out)
    svg = out.read_text()
    assert svg.startswith("<?xml") and all(name in svg for name in results)
    for r in results.values():  # the colours agree with each record's verdict
        assert r["target_met"] == (chart.of_target(r["ratio"], r) >= 1), r["name"]
