"""bench/daemon_update.py, the figure the daemon's update is judged by, still runs end to end:
the script under PS_BENCH_QUICK=1 (small shapes, few repetitions; its figures go to
bench/results/quick/ and mean nothing), so it cannot rot between `make bench` runs. Speed is
never asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bench.common import REPO


@pytest.mark.slow
def test_daemon_update_runs_every_case_and_reports_each_ratio():
    result = subprocess.run(
        [sys.executable, "-m", "bench.daemon_update"], cwd=REPO, capture_output=True, text=True, timeout=170,
        env=dict(os.environ, PS_BENCH_QUICK="1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ("daemon_update", "nonfinite_check", "daemon_update_bf16_state"):
        assert re.search(rf"^{name}: ours [0-9.]+ ms/step, peer [0-9.]+ ms/step, ratio [0-9.]+", result.stdout, re.M), (
            result.stdout[-4000:]
        )
