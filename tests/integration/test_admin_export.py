"""`ps-admin export`: a model trained through two daemons comes back, reassembled from both,
as a safetensors file equal to the trainer's parameters; a model that is not at one step,
has no values, or lives partly on a daemon that is down is refused with one line."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ps_offload import trainer
from ps_offload.proto import ps_pb2
from ps_offload.proto.push import Push
from ps_offload.trainer.debug_models import mlp
from ps_offload.trainer.wire.daemon_client import DaemonClient
from tests.helpers.admin_cli import run_admin

STEPS = 3
SHARD_BYTES = 4096


def _train(addresses: list[str]) -> torch.nn.Module:
    torch.manual_seed(0)
    model = mlp((32, 48, 40, 10))  # 3954 parameters: 4 shards over 2 daemons; shards cut through weights
    g = torch.Generator().manual_seed(1)
    with trainer.offload(
        model,
        daemons=addresses,
        optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1),
        config=trainer.OffloadConfig(shard_bytes=SHARD_BYTES),
    ) as opt:
        for _ in range(STEPS):
            opt.zero_grad()
            model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
            opt.step()
        opt.synchronize()
        assert {s.daemon_index for s in opt.plan} == {0, 1}
    return model


def _assert_equal(path, model: torch.nn.Module) -> None:
    tensors = load_file(str(path))
    params = dict(model.named_parameters())
    assert set(tensors) == set(params)
    for name, param in params.items():
        assert tensors[name].shape == param.shape, name
        assert torch.equal(tensors[name], param.detach()), name


def test_export_reassembles_the_trained_parameters_from_both_daemons(daemon_factory, tmp_path):
    first = daemon_factory("--nvme-dir", str(tmp_path / "nvme"))
    second = daemon_factory()
    model = _train([first.address, second.address])
    # One shard only on disk: export reads it through the daemon like any pull.
    assert run_admin("evict", "0", "--daemon", first.address).returncode == 0

    # Naming one daemon is enough: the other's address comes from the model's spec.
    out = tmp_path / "model.safetensors"
    result = run_admin("export", "--model", "model", "--format", "safetensors", "--out", str(out),
                       "--daemon", first.address)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and f"at version {STEPS}" in result.stdout and str(out) in result.stdout
    _assert_equal(out, model)
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"ps_offload.model": "model", "ps_offload.version": str(STEPS)}

    # Both named, in the other order, and the model found without --model.
    again = tmp_path / "again.safetensors"
    result = run_admin("export", "--out", str(again), "--daemon", second.address, "--daemon", first.address, "--json")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)
    n = sum(p.numel() for p in model.parameters())
    assert (row["model"], row["params"], row["numel"], row["version"]) == ("model", 6, n, str(STEPS))
    assert row["bytes"] == again.stat().st_size > n * 4
    _assert_equal(again, model)
    assert not list(tmp_path.glob("*.tmp"))


def test_export_refuses_a_daemon_of_the_plan_that_is_down(daemon_factory, tmp_path):
    first, second = daemon_factory(), daemon_factory()
    _train([first.address, second.address])
    second.kill()
    out = tmp_path / "m.safetensors"
    result = run_admin("export", "--out", str(out), "--daemon", first.address)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"ps-admin: daemon {second.address} is unreachable")
    assert "name the daemon with --daemon" in result.stderr and result.stderr.count("\n") == 1
    assert not out.exists()


def _register(address: str, name: str) -> DaemonClient:
    client = DaemonClient(address, max_message_bytes=8 << 20)
    spec = ps_pb2.ModelSpec(
        model=name, params=[ps_pb2.ParamSpec(name="w", shape=[2, 1024], dtype=ps_pb2.FLOAT32)],
        optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.5)), shard_bytes=SHARD_BYTES, daemons=[address],
    )  # fmt: skip
    client.register(spec, 0, timeout=10)
    return client


def test_export_refuses_shards_without_values_or_at_different_steps(daemon, tmp_path):
    client = _register(daemon.address, "m")
    out = tmp_path / "m.safetensors"
    empty = run_admin("export", "--out", str(out), "--daemon", daemon.address)
    assert empty.returncode == 1 and "holds no values yet" in empty.stderr and "Traceback" not in empty.stderr

    ones = memoryview(torch.ones(1024).numpy()).cast("B")
    for shard_id in (0, 1):
        client.push(Push.parameters("m", shard_id, ones, step=0), timeout=10)
    client.push(Push.gradient("m", 0, ones, step=0), timeout=10)  # shard 0 at version 1
    client.close()
    mixed = run_admin("export", "--out", str(out), "--daemon", daemon.address)
    assert mixed.returncode == 1 and mixed.stderr.count("\n") == 1
    assert "versions 0 to 1" in mixed.stderr and "--allow-mixed-versions" in mixed.stderr
    assert not out.exists()

    anyway = run_admin("export", "--out", str(out), "--daemon", daemon.address, "--allow-mixed-versions")
    assert anyway.returncode == 0, anyway.stderr
    w = load_file(str(out))["w"]
    assert torch.equal(w, torch.stack([torch.full((1024,), 0.5), torch.ones(1024)]))  # 1 - 0.5 * 1, then 1
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["ps_offload.version"] == "0..1"


def test_export_to_a_missing_directory_is_one_line(daemon, tmp_path):
    client = _register(daemon.address, "m")
    ones = memoryview(torch.ones(1024).numpy()).cast("B")
    for shard_id in (0, 1):
        client.push(Push.parameters("m", shard_id, ones, step=0), timeout=10)
    client.close()
    out = tmp_path / "missing" / "m.safetensors"
    result = run_admin("export", "--out", str(out), "--daemon", daemon.address)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr == f"ps-admin: cannot write {out}: {out.parent} is not a directory\n"
