"""`ps-admin` as an operator runs it: a subprocess against a real daemon that a small model
has been trained through, checked against what the trainer knows (plan, parameters, steps)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import trainer
from ps_daemon.optim import AdamWConfig
from ps_daemon.plan import ShardSlice
from ps_daemon.store import shard_resident_bytes

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
# nn.Linear(64, 40): 2600 parameters; 4 KiB shards hold 1024 each, so 3 shards, the last
# one holding the weight's tail and the bias.
IN_FEATURES, OUT_FEATURES, SHARD_BYTES = 64, 40, 4096


def run_admin(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PS_DAEMON", "COLUMNS")}
    return subprocess.run(
        [sys.executable, "-m", "ps_daemon.admin", *args],
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


@dataclass
class Trained:
    address: str
    plan: list[ShardSlice]
    flat: torch.Tensor  # the model's parameters after training, flattened in spec order
    names: list[str]


def train(address: str, model_name: str = "model") -> Trained:
    torch.manual_seed(0)
    model = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)
    with trainer.offload(
        model,
        daemons=[address],
        optimizer=trainer.AdamW(lr=1e-2),
        model_name=model_name,
        shard_bytes=SHARD_BYTES,
    ) as opt:
        for _ in range(STEPS):
            opt.zero_grad()
            model(torch.randn(8, IN_FEATURES)).pow(2).mean().backward()
            opt.step()
        opt.synchronize()
        plan = list(opt.plan)
    named = list(model.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for _, p in named])
    return Trained(address, plan, flat, [n for n, _ in named])


@pytest.fixture
def trained(daemon) -> Trained:
    result = train(daemon.address)
    assert len(result.plan) == 3
    return result


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shards_json_lists_every_shard_of_the_plan(trained):
    rows = admin_json("shards", "--daemon", trained.address)
    assert [r["shard_id"] for r in rows] == [s.shard_id for s in trained.plan]
    for row, s in zip(rows, trained.plan, strict=True):
        assert row["model"] == "model"
        assert row["daemon"] == trained.address
        assert (row["offset"], row["numel"]) == (s.offset, s.numel)
        assert row["version"] == STEPS
        assert row["initialized"] is True
        assert row["tier"] == "ram"
        # fp32 master + AdamW's m and v, plus the arena's stagger between them
        assert row["bytes"] == shard_resident_bytes(s.numel, AdamWConfig()) > s.numel * 4 * 3
    assert [r["params"] for r in rows] == [["weight"], ["weight"], ["weight", "bias"]]


def test_shard_json_value_stats_match_the_trained_parameters(trained):
    # No --model: the daemon holds one model, so ps-admin picks it.
    for s in trained.plan:
        row = admin_json("shard", str(s.shard_id), "--daemon", trained.address)
        values = trained.flat[s.offset : s.offset + s.numel]
        assert (row["shard_id"], row["numel"], row["version"]) == (s.shard_id, s.numel, STEPS)
        assert row["norm"] == pytest.approx(torch.linalg.vector_norm(values).item(), rel=1e-5)
        assert row["min"] == pytest.approx(values.min().item(), rel=1e-6)
        assert row["max"] == pytest.approx(values.max().item(), rel=1e-6)
        assert row["nan_count"] == 0


def test_stats_json_counts_every_applied_push(trained):
    stats = admin_json("stats", "--daemon", trained.address)
    n = len(trained.plan)
    assert stats["models"] == 1
    assert stats["shards"] == n
    assert stats["pushes_applied"] == STEPS * n
    assert stats["pushes_duplicate"] == 0
    assert stats["ram_bytes_used"] == sum(shard_resident_bytes(s.numel, AdamWConfig()) for s in trained.plan)
    assert stats["uptime_seconds"] > 0


def test_tables_show_headers_and_values(trained):
    shards = run_admin("shards", "--daemon", trained.address)
    assert shards.returncode == 0, shards.stderr
    for header in ("shard", "model", "parameters", "numel", "bytes", "tier", "version", "initialized"):
        assert header in shards.stdout
    lines = shards.stdout.splitlines()
    for s in trained.plan:
        assert any(line.split("│")[1].strip() == str(s.shard_id) for line in lines if line.count("│") > 2)
    assert "14.0 KiB" in shards.stdout and "14336" not in shards.stdout  # human-readable bytes

    one = run_admin("shard", "2", "--daemon", trained.address)
    assert one.returncode == 0, one.stderr
    assert "norm" in one.stdout and "nan_count" in one.stdout and "bias" in one.stdout

    stats = run_admin("stats", "--daemon", trained.address)
    assert stats.returncode == 0, stats.stderr
    assert "pushes_applied" in stats.stdout and "ram_bytes_used" in stats.stdout and "KiB" in stats.stdout


@pytest.mark.parametrize("command", [["shards"], ["shard", "0"], ["stats"]])
def test_unreachable_daemon_is_one_line_and_exit_1(command):
    address = f"127.0.0.1:{closed_port()}"
    result = run_admin(*command, "--daemon", address, "--json")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"ps-admin: daemon {address} is unreachable (UNAVAILABLE: ")
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr


def test_unknown_shard_and_model_are_not_found(trained):
    result = run_admin("shard", "99", "--daemon", trained.address, "--json")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"ps-admin: shard 99 of model 'model' on daemon {trained.address}: NOT_FOUND: ")
    assert "Traceback" not in result.stderr

    result = run_admin("shards", "--model", "nope", "--daemon", trained.address)
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr and "Traceback" not in result.stderr


def test_one_daemon_down_still_lists_the_others(trained):
    down = f"127.0.0.1:{closed_port()}"
    result = run_admin("shards", "--daemon", trained.address, "--daemon", down, "--json")
    assert result.returncode == 1
    assert [r["shard_id"] for r in json.loads(result.stdout)] == [s.shard_id for s in trained.plan]
    assert f"daemon {down} is unreachable" in result.stderr


def test_shard_without_model_on_a_daemon_with_two_models_names_them(trained):
    train(trained.address, model_name="other")
    result = run_admin("shard", "0", "--daemon", trained.address)
    assert result.returncode == 1
    assert "several models (model, other)" in result.stderr and "--model" in result.stderr
    row = admin_json("shard", "0", "--model", "other", "--daemon", trained.address)
    assert row["model"] == "other"


def test_negative_shard_id_is_a_usage_error():
    result = run_admin("shard", "--daemon", "127.0.0.1:1", "--", "-1")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
