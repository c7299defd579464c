"""`ps-admin` as an operator runs it: a subprocess against a real daemon that a small model
has been trained through, checked against what the trainer knows (plan, parameters, steps)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import dataclass

import grpc
import pytest
import torch

import ps_offload
from ps_offload import trainer
from ps_offload.admin import views
from ps_offload.daemon.store.shard import arena_nbytes
from ps_offload.optimizers import AdamW
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.channel import PROTOCOL
from ps_offload.proto.plan import ShardSlice
from tests.helpers.admin_cli import admin_json, run_admin

STEPS = 3
# nn.Linear(64, 40): 2600 parameters; 4 KiB shards hold 1024 each, so 3 shards, the last
# one holding the weight's tail and the bias.
IN_FEATURES, OUT_FEATURES, SHARD_BYTES = 64, 40, 4096


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
        config=trainer.OffloadConfig(model_name=model_name, shard_bytes=SHARD_BYTES),
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
        assert row["bytes"] == arena_nbytes(s.numel, AdamW()) > s.numel * 4 * 3
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
    assert stats["ram_bytes_used"] == sum(arena_nbytes(s.numel, AdamW()) for s in trained.plan)
    assert stats["uptime_seconds"] > 0


def test_tables_show_headers_and_values(trained):
    shards = run_admin("shards", "--daemon", trained.address)
    assert shards.returncode == 0, shards.stderr
    for header in ("shard", "model", "parameters", "numel", "in RAM", "tier", "version", "initialized"):
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


@pytest.mark.parametrize("command", [["shards"], ["shard", "0"], ["stats"], ["evict", "0"]])
def test_a_daemon_without_its_port_is_a_usage_error_not_port_443(command):
    result = run_admin(*command, "--daemon", "localhost")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--daemon localhost: give host:port (its server.listen, e.g. localhost:50051)" in result.stderr


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


# -- shards: filters and order ---------------------------------------------------------


def test_shards_filter_by_param_and_tier_and_sort(trained):
    def ids(*args: str) -> list[int]:
        return [r["shard_id"] for r in admin_json("shards", "--daemon", trained.address, *args)]

    assert ids("--param", "bias") == [2]  # only the last shard holds the bias
    assert ids("--param", "eigh") == [0, 1, 2]  # a substring of "weight"
    assert ids("--param", "nope") == []
    assert ids("--tier", "ram") == [0, 1, 2]
    assert ids("--tier", "nvme") == []  # a RAM-only daemon
    # Shard 2 holds the weight's tail and the bias: fewer elements, fewer bytes.
    assert ids("--sort", "bytes") == [2, 0, 1]
    assert ids("--sort", "bytes", "--reverse") == [1, 0, 2]
    assert ids("--sort", "id", "--reverse") == [2, 1, 0]
    assert ids("--tier", "ram", "--param", "weight", "--sort", "version") == [0, 1, 2]

    bad = run_admin("shards", "--daemon", trained.address, "--tier", "disk")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# -- shard: histogram ------------------------------------------------------------------


def test_shard_histogram_counts_the_master_values(trained):
    s = trained.plan[2]
    values = trained.flat[s.offset : s.offset + s.numel].double()
    row = admin_json("shard", "2", "--daemon", trained.address, "--bins", "7")
    edges, counts = row["histogram"]["edges"], row["histogram"]["counts"]
    assert len(edges) == 8 and len(counts) == 7 and sum(counts) == s.numel
    assert edges[0] == values.min().item() and edges[-1] == values.max().item()
    expected = torch.histc(values, bins=7, min=edges[0], max=edges[-1])
    assert counts == [int(c) for c in expected]

    table = run_admin("shard", "2", "--daemon", trained.address, "--bins", "7")
    assert table.returncode == 0, table.stderr
    bars = [line for line in table.stdout.splitlines() if "█" in line]
    assert len(bars) == 7  # every bin holds values here, so every bin has a bar
    longest = max(bars, key=lambda line: line.count("█"))
    assert str(max(counts)) in longest

    too_many = run_admin("shard", "2", "--daemon", trained.address, "--bins", "1001")
    assert too_many.returncode == 2 and "Traceback" not in too_many.stderr


# -- stats: rates and tier use ---------------------------------------------------------


def test_stats_rates_since_start_and_over_an_interval(trained):
    since_start = admin_json("stats", "--daemon", trained.address)
    n = len(trained.plan)
    assert since_start["rates_since"] == "start"
    assert since_start["pushes_per_second"] == pytest.approx(STEPS * n / since_start["uptime_seconds"], rel=0.05)
    assert since_start["bytes_in_per_second"] > 0 and since_start["bytes_out_per_second"] > 0
    # No NVMe tier: nothing is read from disk, so there is no hit rate to speak of.
    assert since_start["prefetch_hit_rate"] is None and since_start["ram_hit_rate"] is None
    assert since_start["shards_in_ram"] == n and since_start["shards_on_nvme"] == 0
    assert since_start["ram_bytes_budget"] > since_start["ram_bytes_used"] > 0
    assert since_start["nvme_bytes_allocated"] == 0

    idle = admin_json("stats", "--daemon", trained.address, "--interval", "0.3")
    assert idle["rates_since"] == "interval" and idle["rates_seconds"] == pytest.approx(0.3, abs=0.25)
    assert idle["pushes_per_second"] == 0 and idle["pulls_per_second"] == 0  # nobody trains now

    table = run_admin("stats", "--daemon", trained.address)
    assert "pushes_per_second" in table.stdout and "/s" in table.stdout and "prefetch_hit_rate" in table.stdout


def test_stats_rates_from_counters():
    first = {"uptime_seconds": 10.0, "pushes_applied": 5, "pulls": 5, "bytes_pushed": 100, "bytes_pulled": 50}
    first.update(prefetched=0, tier_misses=0, tier_hits=0, nvme_commits=4, nvme_commit_groups=4, nvme_flushes=8)
    last = {"uptime_seconds": 12.0, "pushes_applied": 9, "pulls": 13, "bytes_pushed": 300, "bytes_pulled": 50}
    last.update(prefetched=3, tier_misses=1, tier_hits=6, nvme_commits=10, nvme_commit_groups=6, nvme_flushes=12)
    r = views.rates(last, first)
    assert (r["rates_seconds"], r["pushes_per_second"], r["pulls_per_second"]) == (2.0, 2.0, 4.0)
    assert (r["bytes_in_per_second"], r["bytes_out_per_second"]) == (100.0, 0.0)
    assert r["prefetch_hit_rate"] == 0.75 and r["ram_hit_rate"] == 6 / 7
    assert r["commits_per_group"] == 3.0 and r["flushes_per_commit"] == 4 / 6  # 6 commits in 2 groups
    since_start = views.rates(last)
    assert since_start["pushes_per_second"] == 9 / 12.0
    assert (since_start["commits_per_group"], since_start["flushes_per_commit"]) == (10 / 6, 1.2)
    idle = dict(last, nvme_commits=0, nvme_commit_groups=0, nvme_flushes=0)  # a RAM-only daemon
    assert views.rates(idle)["commits_per_group"] is None and views.rates(idle)["flushes_per_commit"] is None


# -- models ----------------------------------------------------------------------------


def test_models_lists_the_spec_and_the_flat_layout(trained):
    (row,) = admin_json("models", "--daemon", trained.address)
    assert (row["model"], row["daemon_index"], row["daemons"]) == ("model", 0, [trained.address])
    assert row["shard_bytes"] == SHARD_BYTES and row["shards"] == row["shards_here"] == len(trained.plan)
    assert row["optimizer"]["type"] == "adamw" and row["optimizer"]["lr"] == pytest.approx(1e-2)
    weight = IN_FEATURES * OUT_FEATURES
    assert row["params"] == [
        {"name": "weight", "shape": [OUT_FEATURES, IN_FEATURES], "offset": 0, "numel": weight},
        {"name": "bias", "shape": [OUT_FEATURES], "offset": weight, "numel": OUT_FEATURES},
    ]
    assert row["numel"] == trained.flat.numel()
    assert (row["daemon_version"], row["protocol"]) == (ps_offload.__version__, PROTOCOL)


def test_models_names_each_daemons_release_even_without_models(daemon):
    result = run_admin("models", "--daemon", daemon.address)
    assert result.returncode == 0, result.stderr
    assert f"{daemon.address}: ps-offload {ps_offload.__version__}, protocol {PROTOCOL}" in result.stdout


# -- verify on a RAM-only daemon -------------------------------------------------------


def test_verify_on_a_ram_only_daemon_says_nothing_is_at_rest(trained):
    result = run_admin("verify", "--daemon", trained.address)
    assert result.returncode == 0, result.stderr
    assert "RAM only" in result.stdout and "nothing at rest" in result.stdout
    report = admin_json("verify", "--daemon", trained.address)
    (daemon_report,) = report["daemons"]
    assert report["bad"] == 0 and daemon_report["at_rest"] is False
    assert [v["status"] for v in daemon_report["shards"]] == ["not_at_rest"] * len(trained.plan)
    assert all(v["nonfinite"] == 0 and v["version"] == STEPS for v in daemon_report["shards"])


# -- health ----------------------------------------------------------------------------


def test_health_with_a_live_and_a_dead_daemon_names_the_dead_one(daemon):
    dead = f"127.0.0.1:{closed_port()}"
    result = run_admin("health", "--daemon", daemon.address, "--daemon", dead, "--json")
    assert result.returncode == 1
    rows = {r["daemon"]: r for r in json.loads(result.stdout)}
    assert rows[daemon.address]["status"] == "SERVING" and rows[daemon.address]["latency_ms"] > 0
    assert rows[dead]["status"] == "UNREACHABLE"
    assert result.stderr.startswith(f"ps-admin: daemon {dead} is UNREACHABLE (UNAVAILABLE: ")
    assert result.stderr.count("\n") == 1 and daemon.address not in result.stderr

    table = run_admin("health", "--daemon", daemon.address)
    assert table.returncode == 0 and table.stderr == ""
    assert "SERVING" in table.stdout and " ms" in table.stdout


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["verify"],
        ["models"],
        ["export", "--out", "x.safetensors"],
        ["shards", "--tier", "ram"],
        ["stats", "--interval", "0.1"],
    ],
)
def test_unreachable_daemon_is_one_line_for_the_new_commands(command, tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    command = [str(tmp_path / c) if c.endswith(".safetensors") else c for c in command]
    result = run_admin(*command, "--daemon", address)
    assert result.returncode == 1
    assert result.stderr.startswith(f"ps-admin: daemon {address} is unreachable (UNAVAILABLE: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())  # export left no file behind


@pytest.mark.parametrize("command", [["verify", "--model", "nope"], ["export", "--model", "nope", "--out"]])
def test_unknown_model_is_not_found_naming_the_known_ones(trained, command, tmp_path):
    out = [str(tmp_path / "m.safetensors")] if command[-1] == "--out" else []
    result = run_admin(*command, *out, "--daemon", trained.address)
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr and "'nope'" in result.stderr and "registered: model" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "m.safetensors").exists()


def test_unknown_export_format_is_a_usage_error_before_any_call(tmp_path):
    # No daemon listens there: the format is refused before anything is asked.
    result = run_admin("export", "--format", "npz", "--out", str(tmp_path / "m"), "--daemon", "127.0.0.1:1")
    assert result.returncode == 2
    assert result.stderr == "ps-admin: unknown --format 'npz'; supported: safetensors\n"
    assert not list(tmp_path.iterdir())


def test_new_admin_rpcs_answer_bad_input_with_clear_statuses(trained):
    with grpc.insecure_channel(trained.address) as channel:
        stub = ps_pb2_grpc.AdminStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModel(ps_pb2.GetModelRequest(model="nope"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "registered: model" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModel(ps_pb2.GetModelRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ListModels" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Verify(ps_pb2.VerifyRequest(model="nope"), timeout=10))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "registered: model" in info.value.details()
        request = ps_pb2.GetShardRequest(model="model", shard_id=0, histogram_bins=5000)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetShard(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1000" in info.value.details()
        # The daemon is unharmed.
        assert stub.GetModel(ps_pb2.GetModelRequest(model="model"), timeout=10).total_numel == trained.flat.numel()


@pytest.mark.parametrize("module", ["ps_offload.admin.cli", "ps_offload.admin.snapshots"])
def test_the_cli_starts_without_loading_torch(module):
    """Every command but export and snapshot restore/export answers without torch (~3 s of
    start-up each, paid by every test and every operator's call): snapshot take, list and
    delete too."""
    probe = f"import sys, {module}; print(sorted(m for m in ('torch', 'numba') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
