"""The pipeline benchmarks still run end to end: each script's --smoke (a tiny model, one
step under torchrun, nothing recorded) so they cannot rot between `make bench` runs. Speed is
never asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.common import REPO


def _smoke(module: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, "--smoke"], cwd=REPO, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow
def test_pipeline_efficiency_smoke_reports_every_schedule():
    result = _smoke("bench.pipeline_efficiency")
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("gpipe") for line in lines) and any(line.startswith("1f1b") for line in lines)
    assert "t_mb alone per stage" in result.stdout


@pytest.mark.slow
def test_ps_overhead_pp_dp_smoke_runs_through_the_daemons():
    result = _smoke("bench.ps_overhead_pp_dp")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "paired ratios vs in-process: daemons" in result.stdout and "staleness=1" in result.stdout
