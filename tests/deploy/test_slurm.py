"""deploy/slurm/ and `ps-admin cluster-file`: a job's daemon list from real Slurm node lists,
expanded in Slurm's order, written as the cluster file the trainers read; the scripts parse;
the prolog finds a daemon with TLS and a token serving, or drains the node saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ps_offload.daemon.local import LocalDaemon
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


# -- the prolog against a real daemon with TLS and a token ------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory, secured_config):
    """A daemon with [tls] and [auth] as the recipes run it, and the files its clients need."""
    out = tmp_path_factory.mktemp("secured")
    secured_config(out, "127.0.0.1", "ps-node.example")
    daemon = LocalDaemon(out / "d", "--config", str(out / "daemon.toml"))
    try:
        yield daemon, out
    finally:
        daemon.kill()


def _prolog(tmp_path: Path, port: int | None, settings: str) -> subprocess.CompletedProcess:
    """deploy/slurm/prolog.sh with its settings file, ps-admin from this checkout, and a
    systemctl that reports the unit active (no systemd runs here; the daemon is real)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "ps-admin").write_text(f'#!/bin/sh\nexec {sys.executable} -m ps_offload.admin "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    port_setting = f"PS_DAEMON_PORT={port}\n" if port else ""  # else from PS_DAEMON_CONFIG
    (tmp_path / "ps-offload").write_text(settings + port_setting + "PS_DAEMON_WAIT=6\n")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    environment |= {"PATH": f"{bin_dir}:{environment['PATH']}", "PS_OFFLOAD_SETTINGS": str(tmp_path / "ps-offload"),
                    "PS_ADMIN": str(bin_dir / "ps-admin")}  # fmt: skip
    return subprocess.run(["bash", str(SLURM / "prolog.sh")], capture_output=True, text=True, timeout=180,
                          env=environment)  # fmt: skip


def test_the_prolog_finds_a_tls_daemon_serving_with_the_settings_file(secured, tmp_path):
    daemon, files = secured
    settings = f"PS_TLS_CA_FILE={files}/ca.pem\nPS_TOKEN_FILE={files}/token\nPS_TLS_SERVER_NAME=ps-node.example\n"
    done = _prolog(tmp_path, daemon.port, settings)
    assert done.returncode == 0, done.stderr


def test_the_prolog_drains_a_node_saying_why(secured, tmp_path):
    daemon, _ = secured
    done = _prolog(tmp_path, daemon.port, "")  # no CA: plaintext against the TLS port
    assert done.returncode == 1
    assert f"did not answer SERVING on port {daemon.port}" in done.stderr
    assert "give its CA: --ca-file or $PS_TLS_CA_FILE" in done.stderr


def test_the_prolog_takes_the_port_from_the_daemons_own_config(secured, tmp_path):
    """[server] listen's port, not [metrics] listen's (the same key in another section)."""
    daemon, files = secured
    config = tmp_path / "ps-daemon.toml"
    config.write_text(f'[metrics]\nlisten = "127.0.0.1:9477"\n[server]\nlisten = "127.0.0.1:{daemon.port}"\n')
    settings = (f"PS_TLS_CA_FILE={files}/ca.pem\nPS_TOKEN_FILE={files}/token\nPS_TLS_SERVER_NAME=ps-node.example\n"
                f"PS_DAEMON_CONFIG={config}\n")  # fmt: skip
    done = _prolog(tmp_path, None, settings)
    assert done.returncode == 0, done.stderr
