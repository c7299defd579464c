"""Replicated models (OffloadConfig(replicas=2)) over daemons with NVMe tiers, and the ways the
tests lose one: three daemons from conftest's daemon_factory, the offload that replicates over
them, a daemon lost for good (SIGKILLed, its directory deleted), and `ps-admin replicas` as an
operator reads it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

from ps_offload import trainer

DEAD_PEER_SECONDS = 2.0


def nvme_daemons(daemon_factory, tmp_path, n=3):
    """(n daemons, each on an NVMe directory of its own, those directories)."""
    dirs = [tmp_path / f"nvme{i}" for i in range(n)]
    return daemon_factory.together([("--nvme-dir", str(d), "--create-nvme-dir") for d in dirs]), dirs


def offload_replicated(model, daemons, **client):
    """AdamW over `daemons` in 4 KiB shards, each shard on 2 of them; `client` adds
    ClientConfig fields."""
    return trainer.offload(
        model,
        daemons=[d.address for d in daemons],
        optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1),
        config=trainer.OffloadConfig(shard_bytes=4096, replicas=2),
        client=trainer.ClientConfig(dead_peer_seconds=DEAD_PEER_SECONDS, **client),
    )


def lose_for_good(daemon, directory):
    daemon.process.send_signal(signal.SIGKILL)
    daemon.process.wait(timeout=30)
    shutil.rmtree(directory)


def replicas_report(*daemons: str) -> dict:
    """`ps-admin replicas model --json` as an operator runs it (exit 1: some shard degraded)."""
    flags = [flag for address in daemons for flag in ("--daemon", address)]
    done = subprocess.run(
        [sys.executable, "-m", "ps_offload.admin", "replicas", "model", *flags, "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    report = json.loads(done.stdout)
    assert done.returncode == (1 if report["degraded"] else 0), done.stderr
    return report
