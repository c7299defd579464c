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


@pytest.mark.slow
def test_two_ranks_train_against_daemons_with_tls_and_a_token_from_the_environment(tmp_path, secured_config):
    """The README's multi-node set-up with [tls] and [auth] on: the job is given the cluster
    file, the CA and the token file through the environment alone (PS_CLUSTER_FILE,
    PS_TLS_CA_FILE, PS_TOKEN_FILE), as ps-admin is."""
    secured_config(tmp_path, "127.0.0.1", "localhost")
    daemons = [LocalDaemon(tmp_path / f"d{i}", "--config", str(tmp_path / "daemon.toml")) for i in range(2)]
    try:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text("daemons = [{}]\n".format(", ".join(f'"{d.address}"' for d in daemons)))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
        env |= {"PS_CLUSTER_FILE": str(cluster), "PS_TLS_CA_FILE": str(tmp_path / "ca.pem"),
                "PS_TOKEN_FILE": str(tmp_path / "token"), "OMP_NUM_THREADS": "1"}  # fmt: skip
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "examples/train_gpt.py", "--pp", "1", "--dp", "2", "--steps", "20", "--n-layer", "1", "--warmup", "5"],
            capture_output=True, text=True, timeout=170, cwd=ROOT, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", result.stdout).groups())
        assert last < first, result.stdout
        for daemon in daemons:
            assert "UNAUTHENTICATED" not in daemon.log()
    finally:
        for daemon in daemons:
            daemon.kill()
