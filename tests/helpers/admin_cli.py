"""`ps-admin` run as an operator runs it: a subprocess from the repository root, with no
PS_DAEMON or COLUMNS of the caller's leaking in, and its `--json` answers read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# The commands that move a model's bytes (export, snapshot export and restore) took more than
# 30 s on a loaded 2-core CI machine; the rest answer in a few seconds.
MOVES_BYTES = {("export",), ("snapshot", "export"), ("snapshot", "restore")}


def run_admin(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    if timeout is None:
        timeout = 120.0 if args[:1] in MOVES_BYTES or args[:2] in MOVES_BYTES else 30.0
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
