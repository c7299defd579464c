"""Durability on a real daemon with nvme_dir: restarts recover every committed version,
SIGKILL mid-training loses nothing acknowledged, a flipped byte is refused with DATA_LOSS
and named, a full disk fails the push and keeps the last good version."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import grpc
import pytest
import torch

from ps_offload.daemon.local import LocalDaemon
from ps_offload.daemon.tiers.direct_io import FAULT_ENV
from ps_offload.daemon.tiers.nvme import PAGE, SlotHeader
from ps_offload.proto import ps_pb2
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from tests.helpers.persistence_run import (
    assert_same_parameters,
    classifier_case,
    fused_adamw_reference,
    offload_adamw,
    train_and_synchronize,
)


def _daemon(tmp_path: Path, name: str, nvme: Path, *extra: str) -> LocalDaemon:
    return LocalDaemon(tmp_path / name, "--nvme-dir", str(nvme), *extra)


def test_restart_recovers_every_shard_and_training_continues(tmp_path):
    nvme = tmp_path / "nvme"
    model, batches = classifier_case()
    reference = fused_adamw_reference(model, batches)
    first = _daemon(tmp_path, "a", nvme)
    with offload_adamw(model, first.address) as opt:
        train_and_synchronize(opt, model, batches[:10])
    assert first.stop() == 0

    second = _daemon(tmp_path, "b", nvme)  # new ports, same nvme_dir
    try:
        assert "recovered" in second.log()
        resumed, _ = classifier_case()  # fresh initial values: must be replaced by the recovered ones
        with offload_adamw(resumed, second.address) as opt:
            assert opt.step_count == 10
            train_and_synchronize(opt, resumed, batches[10:])
        assert_same_parameters(resumed, reference)
    finally:
        second.kill()


def test_sigkill_mid_training_loses_nothing_acknowledged(tmp_path):
    """The daemon is killed with SIGKILL while steps are in flight and restarted on the same
    gRPC port; the trainer's retries carry on, and the run ends bit-identical to torch."""
    nvme = tmp_path / "nvme"
    model, batches = classifier_case()
    reference = fused_adamw_reference(model, batches)
    daemons = [_daemon(tmp_path, "a", nvme)]
    port = daemons[0].port
    kills = []

    stepped = threading.Condition()

    def killer(opt):
        # Kill when the trainer is mid-run (after some steps), twice, and restart each time.
        for when in (6, 15):
            with stepped:
                assert stepped.wait_for(lambda when=when: opt.step_count >= when, timeout=120)
            daemons[-1].process.send_signal(signal.SIGKILL)
            daemons[-1].process.wait()
            kills.append(opt.step_count)
            daemons.append(_daemon(tmp_path, f"restart{len(daemons)}", nvme, "--listen", f"127.0.0.1:{port}"))

    try:
        with offload_adamw(model, daemons[0].address) as opt:
            step = opt.step

            def step_and_tell() -> None:  # the killer waits on this, not on a clock
                step()
                with stepped:
                    stepped.notify_all()

            opt.step = step_and_tell
            thread = threading.Thread(target=killer, args=(opt,))
            thread.start()
            train_and_synchronize(opt, model, batches)
            thread.join(60)
        assert len(kills) == 2
        assert_same_parameters(model, reference)
    finally:
        for daemon in daemons:
            daemon.kill()


def test_flipped_byte_is_data_loss_for_that_shard_only(tmp_path):
    nvme = tmp_path / "nvme"
    model, batches = classifier_case()
    first = _daemon(tmp_path, "a", nvme)
    with offload_adamw(model, first.address) as opt:
        train_and_synchronize(opt, model, batches[:3])
        plan = opt.plan
    assert first.stop() == 0
    # Flip one byte in the data of every slot whose header names shard 1 (the newest among them
    # is its committed version; the file's layout is recorded beside it).
    layout = json.loads(next(nvme.glob("*.json")).read_text())["layout"]
    arena = next(nvme.glob("*.arena"))
    flipped = 0
    with open(arena, "r+b") as f:
        for slot in range(layout["slots"]):
            f.seek(slot * layout["slot_bytes"])
            header = SlotHeader.unpack(f.read(PAGE))
            if header is None or header.shard_id != 1:
                continue
            at = slot * layout["slot_bytes"] + PAGE + 100
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
            flipped += 1
    assert flipped >= 1
    second = _daemon(tmp_path, "b", nvme)
    try:
        # Recovery reads headers only (a model may exceed RAM); the bytes are checked on first use.
        client = DaemonClient(second.address, max_message_bytes=8 << 20)
        out = memoryview(bytearray(plan[1].numel * 4))
        with pytest.raises(grpc.RpcError) as info:
            client.pull_into(Pull.of("model", 1, min_version=0), out=out, timeout=5)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS and "shard 1" in info.value.details()
        assert "shard 1 of model 'model' is corrupt" in second.log()
        with pytest.raises(grpc.RpcError) as again:  # and stays refused
            client.pull_into(Pull.of("model", 1, min_version=0), out=out, timeout=5)
        assert again.value.code() == grpc.StatusCode.DATA_LOSS
        good = memoryview(bytearray(plan[0].numel * 4))
        assert client.pull_into(Pull.of("model", 0, min_version=0), out=good, timeout=5) == 3
        client.close()
    finally:
        second.kill()


def test_full_disk_fails_the_push_and_keeps_the_last_good_version(tmp_path, monkeypatch):
    nvme = tmp_path / "nvme"
    # Writes per committed version: bytes + header = 2. Registration writes nothing; 3 shards'
    # initial values and one step take 8 writes; the 9th fails.
    monkeypatch.setenv(FAULT_ENV, "ENOSPC@8")
    daemon = _daemon(tmp_path, "a", nvme)
    monkeypatch.delenv(FAULT_ENV)
    try:
        client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        spec = ps_pb2.ModelSpec(
            model="m", params=[ps_pb2.ParamSpec(name="w", shape=[3 * 1024], dtype=ps_pb2.FLOAT32)],
            optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.5)), shard_bytes=4096, daemons=["d"],
        )  # fmt: skip
        client.register(spec, 0, timeout=10)
        ones = memoryview(torch.ones(1024).numpy()).cast("B")
        for shard_id in range(3):
            client.push(Push.parameters("m", shard_id, ones, step=0), timeout=5)
        assert client.push(Push.gradient("m", 0, ones, step=0), timeout=5).version == 1
        with pytest.raises(grpc.RpcError) as info:
            client.push(Push.gradient("m", 1, ones, step=0), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "full" in info.value.details() and "keeps version 0" in info.value.details()
        out = torch.empty(1024)
        assert client.pull_into(Pull.of("m", 1, min_version=0), out=memoryview(out.numpy()).cast("B"), timeout=5) == 0
        assert torch.equal(out, torch.ones(1024))  # the failed update is not visible
        out0 = torch.empty(1024)
        assert client.pull_into(Pull.of("m", 0, min_version=1), out=memoryview(out0.numpy()).cast("B"), timeout=5) == 1
        assert torch.equal(out0, torch.full((1024,), 0.5))  # the good one is
        client.close()
    finally:
        daemon.kill()
    assert os.environ.get(FAULT_ENV) is None
