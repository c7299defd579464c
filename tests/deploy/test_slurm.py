"""deploy/slurm/ and `ps-admin cluster-file`: a job's daemon list from real Slurm node lists,
expanded in Slurm's order, written as the cluster file the trainers read; the scripts parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ps_offload.proto.cluster import read_cluster_file

SLURM = Path(__file__).resolve().parents[2] / "deploy" / "slurm"


def _admin(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ps_offload.admin.cli", "cluster-file", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("nodelist", "nodes"),
    [
        ("node001", ["node001"]),
        ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
        ("gpu-a[01,03-04],gpu-b7", ["gpu-a01", "gpu-a03", "gpu-a04", "gpu-b7"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ],
)
def test_a_slurm_node_list_becomes_the_cluster_file(tmp_path, nodelist, nodes):
    out = tmp_path / "cluster.toml"
    written = _admin("--port", "50061", "--out", str(out), env={"SLURM_JOB_NODELIST": nodelist, "PATH": "/usr/bin"})
    assert written.returncode == 0, written.stderr
    assert read_cluster_file(out) == [f"{n}:50061" for n in nodes]


def test_without_a_node_list_or_with_a_bad_one_it_says_so():
    missing = _admin(env={"PATH": "/usr/bin"})
    assert missing.returncode == 2 and "$SLURM_JOB_NODELIST" in missing.stderr
    bad = _admin("--nodelist", "gpu[003-001")
    assert bad.returncode == 1 and "cannot read the node list 'gpu[003-001'" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("script", sorted(SLURM.iterdir()), ids=lambda p: p.name)
def test_the_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
