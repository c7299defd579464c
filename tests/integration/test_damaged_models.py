"""One damaged model does not take a daemon down: a model whose arena file is truncated or
deleted, or whose record is unreadable, is refused with DATA_LOSS naming the file, shown as
DAMAGED by `ps-admin models`, logged as an ERROR, and kept from being registered over; the
daemon starts and serves its other models bit for bit (it used to stop, taking every model
with it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
import torch

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from tests.helpers.admin_cli import run_admin
from tests.helpers.payloads import tensor_bytes
from tests.helpers.specs import sgd_spec


def _damage(nvme, how: str) -> str:
    """Damages model 'bad'; returns the file the refusal must name."""
    if how == "truncated arena":
        os.truncate(nvme / "bad.arena", 5000)
        return "bad.arena"
    if how == "deleted arena":
        (nvme / "bad.arena").unlink()
        return "bad.arena"
    (nvme / "bad.json").write_text("{ not a record")
    return "bad.json"


@pytest.mark.parametrize("how", ["truncated arena", "deleted arena", "unreadable record"])
def test_a_damaged_model_is_refused_and_the_daemon_serves_the_others(tmp_path, how):
    nvme = tmp_path / "nvme"
    first = LocalDaemon(tmp_path / "first", "--nvme-dir", str(nvme))
    try:
        client = DaemonClient(first.address, max_message_bytes=8 << 20)
        for name in ("good", "bad"):
            client.register(sgd_spec(model=name), 0, timeout=10)
            for shard_id, n in enumerate((1024, 1024, 952)):
                values = torch.arange(n, dtype=torch.float32) + shard_id
                client.push(Push.parameters(name, shard_id, tensor_bytes(values), step=0), timeout=10)
        ack = client.push(Push.gradient("good", 0, tensor_bytes(torch.ones(1024)), step=0), timeout=10)
        assert ack.version == 1
        client.close()
    finally:
        assert first.stop() == 0
    named = _damage(nvme, how)
    daemon = LocalDaemon(tmp_path / "second", "--nvme-dir", str(nvme))
    try:
        client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        out = torch.empty(1024)
        assert client.pull_into(Pull.of("good", 0, min_version=1), out=tensor_bytes(out), timeout=10) == 1
        assert torch.equal(out, torch.arange(1024, dtype=torch.float32) - 0.1)  # SGD lr 0.1, gradient 1
        for call in (
            lambda: client.pull_into(Pull.of("bad", 0, min_version=0), out=tensor_bytes(out), timeout=10),
            lambda: client.register(sgd_spec(model="bad"), 0, timeout=10),  # not registered over its files
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.DATA_LOSS
            assert "model 'bad' could not be recovered at start" in info.value.details()
            assert named in info.value.details()
        assert "model 'bad' could not be recovered" in daemon.log() and "ERROR" in daemon.log()
        listed = subprocess.run(
            [sys.executable, "-m", "ps_offload.admin.cli", "models", "--daemon", daemon.address, "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        rows = {row["model"]: row for row in json.loads(listed.stdout)}
        assert rows["good"]["damaged"] is None and named in rows["bad"]["damaged"]
        # verify of every model is not "all ok": the damaged one is bad, and it exits 1.
        verified = run_admin("verify", "--daemon", daemon.address)
        assert verified.returncode == 1, verified.stdout + verified.stderr
        assert "1 model DAMAGED ('bad')" in verified.stdout
        assert "model 'bad' on daemon" in verified.stderr and named in verified.stderr
        assert run_admin("verify", "--model", "good", "--daemon", daemon.address).returncode == 0
        client.close()
    finally:
        daemon.kill()


def _fill(address: str) -> None:
    client = DaemonClient(address, max_message_bytes=8 << 20)
    for name in ("good", "bad"):
        client.register(sgd_spec(model=name), 0, timeout=10)
        for shard_id, n in enumerate((1024, 1024, 952)):
            values = torch.arange(n, dtype=torch.float32) + shard_id
            client.push(Push.parameters(name, shard_id, tensor_bytes(values), step=0), timeout=10)
    client.close()


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("truncated arena", "bad.arena is truncated: 5000 of"),
        ("deleted arena", "bad.arena was deleted (the daemon still has it open; a restart loses the model)"),
        ("unreadable record", "bad.json cannot be read"),
        ("deleted record", "bad.json was deleted (a restart would not know the model)"),
    ],
)
def test_files_damaged_under_a_running_daemon_make_verify_fail(tmp_path, how, said):
    """The daemon serves from the file it holds open, so its shards still read back: verify
    used to say "all ok" and exit 0 about a model the next restart would lose."""
    nvme = tmp_path / "nvme"
    daemon = LocalDaemon(tmp_path / "d", "--nvme-dir", str(nvme))
    try:
        _fill(daemon.address)
        if how == "deleted record":
            (nvme / "bad.json").unlink()
        else:
            _damage(nvme, how)
        verified = run_admin("verify", "--daemon", daemon.address, "--json")
        assert verified.returncode == 1, verified.stderr
        report = json.loads(verified.stdout)
        assert report["damaged_models"] == 1
        assert said in report["daemons"][0]["damaged"]["bad"]
        assert "good" not in report["daemons"][0]["damaged"]
        assert run_admin("verify", "--model", "good", "--daemon", daemon.address).returncode == 0
    finally:
        daemon.kill()
