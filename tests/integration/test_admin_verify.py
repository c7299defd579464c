"""`ps-admin verify` against real daemons with an NVMe tier: a healthy daemon passes, a byte
flipped on disk is found and named while the daemon goes on serving, and verifying while a
trainer commits new versions reports no false bad shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.daemon.tiers.nvme import PAGE
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.trainer.debug_models import mlp
from tests.helpers.admin_cli import admin_json, run_admin, verify_verdicts
from tests.helpers.nvme_files import committed_slot, flip_byte
from tests.helpers.training import train_linear

SHARD_BYTES = 4096
STEPS = 3


def _nvme_daemon(tmp_path: Path, *extra: str) -> LocalDaemon:
    return LocalDaemon(tmp_path / "d", "--nvme-dir", str(tmp_path / "nvme"), *extra)


def test_verify_passes_then_names_the_shards_flipped_on_disk(tmp_path):
    daemon = _nvme_daemon(tmp_path)
    try:
        plan = train_linear(daemon.address, STEPS)
        ok = run_admin("verify", "--daemon", daemon.address)
        assert ok.returncode == 0, ok.stderr
        assert ok.stderr == "" and "3 shards, 3 ok, 0 bad" in ok.stdout
        # On a terminal (rich's TTY_COMPATIBLE says stderr is one) a progress bar counts the shards.
        env = {k: v for k, v in os.environ.items() if k != "PS_DAEMON"} | {"TTY_COMPATIBLE": "1"}
        shown = subprocess.run([sys.executable, "-m", "ps_offload.admin", "verify", "--daemon", daemon.address],
                               capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
        assert shown.returncode == 0 and f"verify {daemon.address}" in shown.stderr and "3/3" in shown.stderr
        report = admin_json("verify", "--daemon", daemon.address)
        assert report["bad"] == 0 and report["daemons"][0]["at_rest"] is True
        assert {i: (v["status"], v["version"]) for i, v in verify_verdicts(report).items()} == {
            s.shard_id: ("ok", STEPS) for s in plan
        }

        # Shard 0 goes to NVMe only; verify must neither load it nor read through the RAM tier.
        (evicted,) = admin_json("evict", "0", "--daemon", daemon.address)  # --json, as the README says
        assert (evicted["shard_id"], evicted["tier"]) == (0, "nvme")
        read_before = admin_json("stats", "--daemon", daemon.address)["nvme_bytes_read"]

        # Damage the committed copies on disk while the daemon runs: a data byte of shard 1,
        # a header byte of shard 2. Shard 1 stays resident; its RAM copy is untouched.
        nvme = tmp_path / "nvme"
        arena = next(nvme.glob("*.arena"))
        flip_byte(arena, committed_slot(nvme, 1) + PAGE + 100)
        flip_byte(arena, committed_slot(nvme, 2) + 20)

        bad = run_admin("verify", "--daemon", daemon.address)
        assert bad.returncode == 1
        assert "3 shards, 1 ok, 2 bad" in bad.stdout and "bad shards" in bad.stdout
        lines = bad.stderr.splitlines()
        assert len(lines) == 2 and "Traceback" not in bad.stderr
        assert lines[0].startswith(f"ps-admin: shard 1 of model 'model' on daemon {daemon.address} is bad: checksum")
        assert lines[1].startswith("ps-admin: shard 2 of model 'model'") and "header" in lines[1]

        result = run_admin("verify", "--daemon", daemon.address, "--json")
        assert result.returncode == 1
        verdicts = verify_verdicts(json.loads(result.stdout))
        assert verdicts[0]["status"] == "ok" and verdicts[0]["tier"] == "nvme"
        assert verdicts[1]["status"] == "bad" and "checksum mismatch" in verdicts[1]["detail"]
        assert "resident" in verdicts[1]["detail"]  # its next update writes a good copy
        assert verdicts[2]["status"] == "bad" and "fails its own checksum" in verdicts[2]["detail"]

        # Nothing was loaded, evicted or marked, and the daemon serves on.
        tiers = {r["shard_id"]: r["tier"] for r in admin_json("shards", "--daemon", daemon.address)}
        assert tiers == {0: "nvme", 1: "ram", 2: "ram"}
        assert admin_json("stats", "--daemon", daemon.address)["nvme_bytes_read"] == read_before
        assert run_admin("health", "--daemon", daemon.address).returncode == 0
        assert admin_json("shard", "1", "--daemon", daemon.address)["version"] == STEPS
    finally:
        daemon.kill()


def test_shards_filter_and_sort_by_tier(tmp_path):
    daemon = _nvme_daemon(tmp_path)
    try:
        train_linear(daemon.address, 1)
        assert run_admin("evict", "1", "--daemon", daemon.address).returncode == 0

        def ids(*args: str) -> list[int]:
            return [r["shard_id"] for r in admin_json("shards", "--daemon", daemon.address, *args)]

        assert ids("--tier", "nvme") == [1]
        assert ids("--tier", "ram") == [0, 2]
        assert ids("--tier", "corrupt") == []
        assert ids("--sort", "tier") == [0, 2, 1]  # ram, then nvme
        assert ids("--sort", "tier", "--reverse") == [1, 2, 0]
        # At a glance: a glyph per shard in id order, per model and daemon.
        shown = run_admin("shards", "--map", "--daemon", daemon.address)
        assert shown.returncode == 0, shown.stderr
        assert f"model on {daemon.address}: 3 shards (1 nvme, 2 ram)" in shown.stdout
        assert "      0 RnR" in shown.stdout
    finally:
        daemon.kill()


def _verify_rpc(address: str) -> list[ps_pb2.ShardVerdict]:
    with grpc.insecure_channel(address) as channel:
        answers = list(ps_pb2_grpc.AdminStub(channel).Verify(ps_pb2.VerifyRequest(), timeout=60))
    assert answers[0].HasField("plan") and answers[0].plan.shards == len(answers) - 1
    return [a.shard for a in answers[1:]]


@pytest.mark.slow
def test_verify_while_training_reports_no_false_bad_shards(tmp_path):
    """One spare slot: a slot freed by one shard's commit is at once rewritten by the next
    commit, so a verify that read a slot without caring about commits in between would read
    torn bytes. Many small shards keep the trainer committing all the time."""
    config = tmp_path / "ps-daemon.toml"
    config.write_text("[store]\nnvme_spare_slots = 1\nfsync = false\n")
    daemon = LocalDaemon(tmp_path / "d", "--nvme-dir", str(tmp_path / "nvme"), "--config", str(config))
    try:
        torch.manual_seed(0)
        model = mlp((256, 512, 512, 10))  # about 400k parameters: 25 shards of 16384
        g = torch.Generator().manual_seed(1)
        with trainer.offload(
            model,
            daemons=[daemon.address],
            optimizer=trainer.AdamW(lr=1e-3),
            config=trainer.OffloadConfig(shard_bytes=16 * SHARD_BYTES),
        ) as opt:
            done = threading.Event()

            def train() -> None:
                try:
                    while not done.is_set():
                        opt.zero_grad()
                        model(torch.randn(16, 256, generator=g)).pow(2).mean().backward()
                        opt.step()
                finally:
                    done.set()

            thread = threading.Thread(target=train)
            thread.start()
            try:
                rounds, versions, cli = 0, set(), None
                while rounds < 400 and (rounds < 100 or len(versions) < 10):
                    verdicts = _verify_rpc(daemon.address)
                    bad = [(v.shard_id, v.detail) for v in verdicts if v.status == ps_pb2.VERIFY_BAD]
                    assert not bad, f"round {rounds}: {bad}"
                    assert all(v.status == ps_pb2.VERIFY_OK for v in verdicts)
                    versions |= {v.version for v in verdicts}
                    rounds += 1
                    if cli is None:  # once through the CLI too, while training goes on
                        cli = run_admin("verify", "--daemon", daemon.address)
                        assert cli.returncode == 0, cli.stdout + cli.stderr
            finally:
                done.set()
                thread.join(60)
            opt.synchronize()
        # The trainer committed throughout: verify saw many versions go by.
        assert len(versions) >= 10, versions
        assert run_admin("verify", "--daemon", daemon.address).returncode == 0
    finally:
        daemon.kill()
