"""`ps-admin drop`: a model leaves a daemon for good (RAM, arena file, record, versions
record) while the daemon serves its other models bit for bit; a pull waiting on it ends with
NOT_FOUND at once; the name can be registered again; a damaged model is dropped by deleting
its files; and without --yes on a non-terminal nothing is dropped."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from tests.helpers.admin_cli import admin_json, run_admin
from tests.helpers.payloads import tensor_bytes
from tests.helpers.specs import sgd_spec

SHARD_SIZES = (1024, 1024, 952)  # sgd_spec's plan


def _fill(client: DaemonClient, name: str, offset: float) -> None:
    client.register(sgd_spec(model=name), 0, timeout=10)
    for shard_id, n in enumerate(SHARD_SIZES):
        values = torch.arange(n, dtype=torch.float32) + offset + shard_id
        client.push(Push.parameters(name, shard_id, tensor_bytes(values), step=0), timeout=10)
    ack = client.push(Push.gradient(name, 0, tensor_bytes(torch.ones(1024)), step=0), timeout=10)
    assert ack.version == 1


def _pulled(client: DaemonClient, name: str, shard_id: int = 0, min_version: int = 1) -> torch.Tensor:
    out = torch.empty(SHARD_SIZES[shard_id])
    client.pull_into(Pull.of(name, shard_id, min_version=min_version), out=tensor_bytes(out), timeout=10)
    return out


def _files_of(nvme, name: str) -> list[str]:
    return sorted(p.name for p in nvme.iterdir() if p.name.startswith(f"{name}."))


def test_drop_frees_the_model_and_leaves_the_others_untouched(tmp_path):
    nvme = tmp_path / "nvme"
    daemon = LocalDaemon(tmp_path / "d", "--nvme-dir", str(nvme))
    try:
        client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        _fill(client, "kept", 0.0)
        _fill(client, "gone", 100.0)
        kept_before = _pulled(client, "kept")

        refused = run_admin("drop", "gone", "--daemon", daemon.address)  # stdin is not a terminal
        assert refused.returncode == 2 and "pass --yes" in refused.stderr
        assert torch.equal(_pulled(client, "gone"), torch.arange(1024, dtype=torch.float32) + 100.0 - 0.1)

        # A pull waiting for a version that would never come ends as soon as the model goes.
        waited: list[BaseException] = []
        waiting = threading.Thread(
            target=lambda: waited.append(_raised(lambda: _pulled(client, "gone", shard_id=1, min_version=5)))
        )
        waiting.start()
        deadline = time.monotonic() + 120
        while admin_json("stats", "--daemon", daemon.address)["pulls_waiting"] != 1:  # each asks anew
            assert waiting.is_alive(), waited
            assert time.monotonic() < deadline, "the pull did not start waiting within 120 s"

        dropped = run_admin("drop", "gone", "--daemon", daemon.address, "--yes")
        assert dropped.returncode == 0, dropped.stderr
        assert f"dropped model 'gone' on {daemon.address}: 3 shards" in dropped.stdout
        waiting.join(timeout=30)
        assert not waiting.is_alive()
        (error,) = waited
        assert error.code() == grpc.StatusCode.NOT_FOUND and "dropped" in error.details()

        assert _files_of(nvme, "gone") == []
        assert [row["model"] for row in admin_json("models", "--daemon", daemon.address)] == ["kept"]
        with pytest.raises(grpc.RpcError) as info:
            _pulled(client, "gone")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "model 'gone' was dropped from this daemon" in info.value.details()  # not "not registered"
        assert torch.equal(_pulled(client, "kept"), kept_before)

        again = run_admin("drop", "gone", "--daemon", daemon.address, "--yes")
        assert again.returncode == 1 and "NOT_FOUND" in again.stderr and "Traceback" not in again.stderr

        _fill(client, "gone", 7.0)  # the name is free: a new model, from its own values
        assert torch.equal(_pulled(client, "gone"), torch.arange(1024, dtype=torch.float32) + 7.0 - 0.1)
        client.close()
    finally:
        assert daemon.stop() == 0
    restarted = LocalDaemon(tmp_path / "r", "--nvme-dir", str(nvme))
    try:
        client = DaemonClient(restarted.address, max_message_bytes=8 << 20)
        assert torch.equal(_pulled(client, "gone"), torch.arange(1024, dtype=torch.float32) + 7.0 - 0.1)
        assert torch.equal(_pulled(client, "kept"), kept_before)
        client.close()
    finally:
        restarted.kill()


def _raised(call) -> BaseException | None:
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    return None


def test_a_damaged_model_is_dropped_by_deleting_its_files(tmp_path):
    nvme = tmp_path / "nvme"
    first = LocalDaemon(tmp_path / "a", "--nvme-dir", str(nvme))
    try:
        client = DaemonClient(first.address, max_message_bytes=8 << 20)
        _fill(client, "bad", 0.0)
        client.close()
    finally:
        assert first.stop() == 0
    (nvme / "bad.json").write_text("{ not a record")
    daemon = LocalDaemon(tmp_path / "b", "--nvme-dir", str(nvme))
    try:
        dropped = run_admin("drop", "bad", "--daemon", daemon.address, "--yes")
        assert dropped.returncode == 0, dropped.stderr
        assert "dropped damaged model 'bad'" in dropped.stdout
        assert _files_of(nvme, "bad") == []
        assert admin_json("models", "--daemon", daemon.address) == []
        client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        _fill(client, "bad", 3.0)  # registered anew: it was refused while its files were there
        client.close()
    finally:
        daemon.kill()


def test_ram_only_drop_returns_the_memory(tmp_path):
    daemon = LocalDaemon(tmp_path / "d")
    try:
        client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        _fill(client, "m", 0.0)
        assert admin_json("stats", "--daemon", daemon.address)["ram_bytes_used"] > 0
        (row,) = admin_json("drop", "m", "--daemon", daemon.address, "--yes")
        assert row["shards"] == 3 and row["ram_bytes"] > 0 and row["disk_bytes"] == 0
        stats = admin_json("stats", "--daemon", daemon.address)
        assert (stats["models"], stats["ram_bytes_used"]) == (0, 0)
        client.close()
    finally:
        daemon.kill()


def test_drop_while_pushes_run_ends_them_with_not_found_and_nothing_else(tmp_path):
    """Pushes in flight or arriving during the drop end with NOT_FOUND (never INTERNAL, never
    a traceback), whichever point of the drop they meet."""
    nvme = tmp_path / "nvme"
    daemon = LocalDaemon(tmp_path / "d", "--nvme-dir", str(nvme))
    try:
        client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        _fill(client, "busy", 0.0)
        started, outcomes = threading.Event(), []

        def push_until_refused(shard_id: int) -> None:
            step = 1 if shard_id == 0 else 0
            grad = tensor_bytes(torch.ones(SHARD_SIZES[shard_id]))
            while True:
                try:
                    client.push(Push.gradient("busy", shard_id, grad, step=step), timeout=30)
                except grpc.RpcError as exc:
                    outcomes.append(exc)
                    return
                step += 1
                started.set()

        pushers = [threading.Thread(target=push_until_refused, args=(i,)) for i in range(3)]
        for pusher in pushers:
            pusher.start()
        assert started.wait(60)
        dropped = run_admin("drop", "busy", "--daemon", daemon.address, "--yes")
        assert dropped.returncode == 0, dropped.stderr
        for pusher in pushers:
            pusher.join(timeout=60)
        assert [exc.code() for exc in outcomes] == [grpc.StatusCode.NOT_FOUND] * 3, [e.details() for e in outcomes]
        assert _files_of(nvme, "busy") == []
        assert "Traceback" not in daemon.log()
        assert run_admin("health", "--daemon", daemon.address).returncode == 0
        client.close()
    finally:
        daemon.kill()


def test_a_snapshot_waiting_for_its_step_ends_not_found_when_the_model_is_dropped(tmp_path):
    """It used to wait out its 600 s holding one of the daemon's two snapshot slots."""
    nvme = tmp_path / "nvme"
    daemon = LocalDaemon(tmp_path / "d", "--nvme-dir", str(nvme))
    try:
        client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        _fill(client, "going", 0.0)
        admin = ps_pb2_grpc.AdminStub(client.channel)
        request = ps_pb2.CreateSnapshotRequest(model="going", name="later", step=50, wait_seconds=600)
        waiting = admin.CreateSnapshot.future(request, timeout=120)
        deadline = time.monotonic() + 60
        listing = ps_pb2.ListSnapshotsRequest(model="going")
        while "later" not in [s.name for s in admin.ListSnapshots(listing).snapshots]:
            assert time.monotonic() < deadline, "the snapshot never began waiting"
            time.sleep(0.05)
        started = time.monotonic()
        assert run_admin("drop", "going", "--daemon", daemon.address, "--yes").returncode == 0
        with pytest.raises(grpc.RpcError) as ended:
            waiting.result(timeout=60)
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND
        assert "was dropped while snapshot 'later' waited for step 50" in ended.value.details()
        assert time.monotonic() - started < 30
        # Both snapshot slots are free again: two more can wait at once (a third is refused).
        _fill(client, "again", 0.0)
        waits = [
            admin.CreateSnapshot.future(
                ps_pb2.CreateSnapshotRequest(model="again", name=f"s{i}", step=50, wait_seconds=1), timeout=60
            )
            for i in range(2)
        ]
        for w in waits:
            with pytest.raises(grpc.RpcError) as late:
                w.result(timeout=60)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # its own wait, not "2 being taken"
        assert _files_of(nvme, "going") == []
        client.close()
    finally:
        daemon.kill()


def test_a_drop_that_names_some_of_a_models_daemons_drops_nothing_unless_partial(tmp_path):
    """It used to drop the model on the daemons named and exit 0, leaving a part its trainers
    could not register again. Now every daemon of the model must be named (told by each
    daemon's index in the plan, however the admin spells the address), or --partial given;
    a trainer whose model was dropped is told so."""
    from ps_offload import trainer
    from ps_offload.trainer.debug_models import mlp

    first = LocalDaemon(tmp_path / "a", "--nvme-dir", str(tmp_path / "nvme-a"))
    second = LocalDaemon(tmp_path / "b", "--nvme-dir", str(tmp_path / "nvme-b"))
    try:
        torch.manual_seed(0)
        model = mlp((32, 64, 10))
        config = trainer.OffloadConfig(shard_bytes=4096)
        with trainer.offload(
            model, daemons=[first.address, second.address], optimizer=trainer.SGD(lr=0.1), config=config
        ) as opt:
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.synchronize()
            name = config.model_name
            refused = run_admin("drop", name, "--daemon", first.address, "--yes")
            assert refused.returncode == 2, refused.stderr
            assert f"also has shards on {second.address}" in refused.stderr and "nothing was dropped" in refused.stderr
            assert [r["model"] for r in admin_json("models", "--daemon", first.address)] == [name]
            # Another spelling of the same daemons is the same set.
            spelled = [a.replace("127.0.0.1", "localhost") for a in (first.address, second.address)]
            dropped = run_admin("drop", name, "--daemon", spelled[0], "--daemon", spelled[1], "--yes")
            assert dropped.returncode == 0, dropped.stderr
            with pytest.raises(Exception, match=f"model '{name}' was dropped from this daemon"):
                model(torch.randn(4, 32)).sum().backward()
                opt.step()
                opt.synchronize()
        trainer_again = mlp((32, 64, 10))
        with trainer.offload(
            trainer_again, daemons=[first.address, second.address], optimizer=trainer.SGD(lr=0.1), config=config
        ):
            pass  # registered anew
        partial = run_admin("drop", name, "--daemon", second.address, "--yes", "--partial")
        assert partial.returncode == 0, partial.stderr
        assert [r["model"] for r in admin_json("models", "--daemon", first.address)] == [name]
    finally:
        first.kill()
        second.kill()
