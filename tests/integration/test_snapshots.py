"""`ps-admin snapshot`: a consistent cut of a model at one step across its daemons, kept by
pinning slots (no copy), surviving a restart, and restored onto another number of daemons
with another shard size, from which training resumes bit for bit as if never interrupted."""

from __future__ import annotations

import copy
import json
import threading
import time

import grpc
import pytest
import torch
from safetensors.torch import load_file

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.push import Push
from ps_offload.trainer.wire.daemon_client import DaemonClient
from tests.helpers.admin_cli import admin_json, run_admin
from tests.helpers.payloads import tensor_bytes
from tests.helpers.snapshots import (
    CUT,
    daemon_args,
    fresh_mlp,
    nvme_daemon,
    offload_mlp,
    resumes_as_uninterrupted,
    teacher_batches,
    train_step,
)
from tests.helpers.specs import sgd_spec


def test_resumed_from_a_snapshot_on_another_cluster_equals_the_uninterrupted_run(tmp_path):
    batches = teacher_batches()
    sources = [nvme_daemon(tmp_path, f"src{i}") for i in range(2)]
    targets: list[LocalDaemon] = []
    try:
        model = fresh_mlp()
        with offload_mlp(model, [d.address for d in sources], 4096) as opt:  # 2 daemons, 4 shards
            for batch in batches[:CUT]:
                train_step(opt, model, batch)
            opt.synchronize()
            taken = admin_json("snapshot", "take", "model", "cut", *daemon_args(sources[0]))
            assert [(r["step"], r["complete"]) for r in taken] == [(CUT, True), (CUT, True)]  # both daemons
            for batch in batches[CUT:]:  # the run goes on past the snapshot
                train_step(opt, model, batch)
            opt.synchronize()
        uninterrupted = copy.deepcopy(model)

        # The source daemons restart: the snapshot is recovered with them, still readable.
        for i, daemon in enumerate(sources):
            assert daemon.stop() == 0
            sources[i] = LocalDaemon(daemon.workdir.with_name(f"src{i}b"), "--nvme-dir", str(daemon.workdir / "nvme"))
        # (new ports: both are named, as the spec's addresses are stale)
        listed = admin_json("snapshot", "list", "model", *daemon_args(*sources))
        assert [(r["name"], r["step"], r["complete"], r["damaged"]) for r in listed] == [("cut", CUT, True, None)] * 2

        # Restored onto one other daemon, with shards twice as large (the plan re-cut).
        targets.append(nvme_daemon(tmp_path, "dst"))
        restored = admin_json(
            "snapshot", "restore", "model", "cut", "--to", targets[0].address, "--shard-bytes", "8192",
            *daemon_args(*sources),
        )  # fmt: skip
        assert (restored["step"], restored["shards"], restored["shards_restored"]) == (CUT, 4, 4)
        again = admin_json("snapshot", "restore", "model", "cut", "--to", targets[0].address, "--shard-bytes",
                           "8192", *daemon_args(*sources))  # fmt: skip
        assert again["shards_restored"] == 0  # run again: every shard holds it already
        resumes_as_uninterrupted(targets[0].address, 8192, batches, uninterrupted)
    finally:
        for daemon in sources + targets:
            daemon.kill()


def test_taken_while_training_at_a_later_step_and_restored_onto_three_daemons(tmp_path):
    batches = teacher_batches()
    source = nvme_daemon(tmp_path, "src")
    targets = [nvme_daemon(tmp_path, f"dst{i}") for i in range(3)]
    try:
        model = fresh_mlp()
        with offload_mlp(model, [source.address], 4096) as opt:
            train_step(opt, model, batches[0])
            opt.synchronize()
            result = {}
            taking = threading.Thread(
                target=lambda: result.update(
                    out=run_admin(
                        "snapshot",
                        "take",
                        "model",
                        "later",
                        "--step",
                        "3",
                        "--json",
                        "--daemon",
                        source.address,
                        timeout=120,
                    )  # fmt: skip
                )
            )
            taking.start()
            _await_pending(source.address, "later")  # the trainer must not pass step 3 before it is asked
            at_three = None
            for i, batch in enumerate(batches[1:6], start=1):
                train_step(opt, model, batch)
                if i == 2:  # batches 0..2 applied: version 3
                    opt.synchronize()
                    at_three = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.synchronize()
            taking.join(timeout=120)
            assert result["out"].returncode == 0, result["out"].stderr
            assert json.loads(result["out"].stdout)[0]["step"] == 3

            refused = run_admin("snapshot", "take", "model", "late", "--step", "2", "--daemon", source.address)
            assert refused.returncode == 1 and "past step 2" in refused.stderr and "Traceback" not in refused.stderr
            bad_name = run_admin("snapshot", "take", "model", "../x", "--daemon", source.address)
            assert bad_name.returncode == 1 and "INVALID_ARGUMENT" in bad_name.stderr
            never = run_admin("snapshot", "take", "model", "never", "--step", "99", "--timeout", "4",
                              "--daemon", source.address)  # fmt: skip
            assert never.returncode == 1 and "was cancelled" in never.stderr
            names = [r["name"] for r in admin_json("snapshot", "list", "model", "--daemon", source.address)]
            assert names == ["later"]

        out = tmp_path / "restored.safetensors"
        to = [a for d in targets for a in ("--to", d.address)]
        restored = admin_json(
            "snapshot", "restore", "model", "later", "--as", "model-3", *to, "--daemon", source.address
        )
        assert restored["step"] == 3 and restored["shards_restored"] == restored["shards"] >= 3
        exported = run_admin("export", "--model", "model-3", "--out", str(out), "--daemon", targets[0].address)
        assert exported.returncode == 0, exported.stderr
        tensors = load_file(str(out))
        for name, values in at_three.items():
            assert torch.equal(tensors[name], values), name

        deleted = admin_json("snapshot", "delete", "model", "later", "--daemon", source.address)
        assert deleted[0]["name"] == "later"
        assert admin_json("snapshot", "list", "model", "--daemon", source.address) == []
    finally:
        for daemon in [source, *targets]:
            daemon.kill()


def _await_pending(address: str, name: str) -> None:
    """Returns once the daemon lists snapshot `name` (being taken): the request arrived."""
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.AdminStub(channel)
        deadline = time.monotonic() + 120
        while name not in {s.name for s in stub.ListSnapshots(ps_pb2.ListSnapshotsRequest(model="model")).snapshots}:
            assert time.monotonic() < deadline, f"snapshot {name!r} was not asked for within 120 s"
            time.sleep(0.02)  # the request's arrival reaches the test by no event


def test_a_ram_only_daemon_says_snapshots_need_the_nvme_tier(tmp_path):
    daemon = LocalDaemon(tmp_path / "d")
    try:
        model = fresh_mlp()
        with offload_mlp(model, [daemon.address], 4096) as opt:
            train_step(opt, model, teacher_batches()[0])
            opt.synchronize()
        refused = run_admin("snapshot", "take", "model", "s", "--daemon", daemon.address)
        assert refused.returncode == 1 and "no NVMe tier" in refused.stderr
    finally:
        daemon.kill()


def test_snapshots_pin_slots_and_deleting_gives_them_back(tmp_path):
    """While snapshots live, commits go on in the slots the file grew by; deleting them frees
    their slots for reuse (the file does not grow again for the next snapshot)."""
    batches, count = teacher_batches(), 2
    daemon = nvme_daemon(tmp_path, "d")
    arena = tmp_path / "d" / "nvme" / "model.arena"
    try:
        model = fresh_mlp()
        with offload_mlp(model, [daemon.address], 4096) as opt:
            train_step(opt, model, batches[0])
            opt.synchronize()
            before = arena.stat().st_size
            for i in range(count):
                admin_json("snapshot", "take", "model", f"s{i}", "--daemon", daemon.address)
                train_step(opt, model, batches[1 + i])
                opt.synchronize()
            grown = arena.stat().st_size
            assert grown > before
            for i in range(count):
                admin_json("snapshot", "delete", "model", f"s{i}", "--daemon", daemon.address)
            for batch in batches[1 + count :]:
                train_step(opt, model, batch)
            opt.synchronize()
            assert arena.stat().st_size == grown
            verified = run_admin("verify", "--daemon", daemon.address)
            assert verified.returncode == 0, verified.stdout + verified.stderr
    finally:
        daemon.kill()


def test_bad_state_pushes_are_refused_and_change_nothing(tmp_path):
    daemon = LocalDaemon(tmp_path / "d")
    try:
        client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
        spec = sgd_spec(model="m")
        spec.optimizer.CopyFrom(ps_pb2.OptimizerSpec(adamw=ps_pb2.AdamWSpec(lr=0.01)))
        client.register(spec, 0, timeout=10)  # AdamW: master, exp_avg, exp_avg_sq
        n = 1024

        def state(*, v: float = 1.0, values: int = 3 * n, step: int = 5):
            data = torch.ones(values)
            data[2 * n :] = v
            return client.push(Push.state("m", 0, tensor_bytes(data), step=step), timeout=10)

        for call, code, words in (
            (
                lambda: state(values=n),
                grpc.StatusCode.INVALID_ARGUMENT,
                "a STATE: the master and 2 optimizer state tensors): header says 4096 bytes, the shard needs 3072",
            ),
            (lambda: state(v=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "exp_avg_sq"),
            (lambda: state(v=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "exp_avg_sq"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == code and words in info.value.details(), info.value.details()
        shard = admin_json("shard", "0", "--model", "m", "--daemon", daemon.address)
        assert (shard["version"], shard["initialized"]) == (0, False)  # nothing changed

        assert state().applied and not state().applied  # applied, then a duplicate
        assert admin_json("shard", "0", "--model", "m", "--daemon", daemon.address)["version"] == 5
        client.push(Push.gradient("m", 0, tensor_bytes(torch.ones(n)), step=5), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            state(step=2)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "has had 6 updates" in info.value.details()
        client.close()
    finally:
        daemon.kill()


def test_waiting_snapshots_are_bounded_and_a_caller_that_leaves_frees_its_thread(tmp_path):
    daemon = nvme_daemon(tmp_path, "d")
    try:
        model = fresh_mlp()
        with offload_mlp(model, [daemon.address], 4096) as opt:
            train_step(opt, model, teacher_batches()[0])
            opt.synchronize()
        with grpc.insecure_channel(daemon.address) as channel:
            stub = ps_pb2_grpc.AdminStub(channel)

            def create(name: str):
                request = ps_pb2.CreateSnapshotRequest(model="model", name=name, step=99, wait_seconds=600)
                return stub.CreateSnapshot.future(request, timeout=600)

            waiting = [create("a"), create("b")]  # step 99 never comes: both wait
            _await_pending(daemon.address, "a")
            _await_pending(daemon.address, "b")
            with pytest.raises(grpc.RpcError) as info:
                create("c").result()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 snapshots are being taken" in info.value.details()
            assert run_admin("health", "--daemon", daemon.address).returncode == 0
            for call in waiting:
                call.cancel()
            # Cancelled callers free their waits at once: the snapshots are gone and a new one is taken.
            deadline = time.monotonic() + 60
            while stub.ListSnapshots(ps_pb2.ListSnapshotsRequest(model="model")).snapshots:
                assert time.monotonic() < deadline, "cancelled snapshots still wait"
                time.sleep(0.02)
            assert stub.CreateSnapshot(
                ps_pb2.CreateSnapshotRequest(model="model", name="now", step=1), timeout=30
            ).complete
    finally:
        daemon.kill()
