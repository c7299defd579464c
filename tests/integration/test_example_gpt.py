"""examples/train_gpt.py as a user runs it: under torchrun with --pp 2 --dp 2 over two
daemons found through a cluster file, with the delayed update; the loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ps_offload.daemon.local import LocalDaemon

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpt_example_trains_with_pp_dp_and_staleness_over_a_cluster_file(tmp_path):
    daemons = [LocalDaemon(tmp_path / f"d{i}") for i in range(2)]
    try:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text("daemons = [{}]\n".format(", ".join(f'"{d.address}"' for d in daemons)))
        env = {**os.environ, "PS_CLUSTER_FILE": str(cluster), "OMP_NUM_THREADS": "1"}
        env.pop("PS_DAEMONS", None)
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
             "examples/train_gpt.py", "--pp", "2", "--dp", "2", "--staleness", "1", "--steps", "50",
             "--n-layer", "2", "--warmup", "5"],
            capture_output=True, text=True, timeout=150, cwd=ROOT, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        assert "2 stages x 2 replicas" in result.stdout and daemons[1].address in result.stdout
        first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", result.stdout).groups())
        assert last < first - 0.8, result.stdout  # 4.0 -> about 2.8: it learned, not drifted
        for daemon in daemons:  # each stage is a model of its own, spread over both daemons
            assert daemon.process.poll() is None
    finally:
        for daemon in daemons:
            daemon.kill()


def test_example_without_daemons_says_how_to_give_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PS_DAEMONS", "PS_CLUSTER_FILE")}
    result = subprocess.run(
        [sys.executable, "examples/train_gpt.py", "--steps", "1"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert result.returncode != 0
    assert "no daemons given: pass --daemons" in result.stderr
    assert "Traceback" not in result.stderr
