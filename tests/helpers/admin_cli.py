"""`ps-admin` run as an operator runs it: a subprocess from the repository root, with no
PS_DAEMON or COLUMNS of the caller's leaking in, and its `--json` answers read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_admin(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PS_DAEMON", "COLUMNS")}
    return subprocess.run(
        [sys.executable, "-m", "ps_offload.admin", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )


def admin_json(*args: str) -> object:
    result = run_admin(*args, "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return json.loads(result.stdout)  # stdout holds the JSON and nothing else


def verify_verdicts(report: dict) -> dict[int, dict]:
    """`ps-admin verify --json` of one daemon: its verdicts by shard id."""
    (daemon_report,) = report["daemons"]
    return {v["shard_id"]: v for v in daemon_report["shards"]}
