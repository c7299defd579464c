"""`make bench-scale` says what it needs before it starts, and refuses a disk too small."""

from __future__ import annotations

import subprocess
import sys

from bench.common import REPO


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.scale", "--check-only", *args], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_check_only_reports_the_size_and_the_disk_it_needs():
    result = _run("--ram-multiple", "0.01")
    assert result.returncode == 0, result.stderr
    assert "B parameters" in result.stdout and "GB of disk" in result.stdout


def test_a_disk_too_small_is_refused_with_what_it_needs():
    result = _run("--ram-multiple", "1000")  # 1000x RAM: no test machine has that much disk
    assert result.returncode != 0
    assert "bench-scale: needs" in result.stderr and "GB free under" in result.stderr
    assert "Traceback" not in result.stderr
