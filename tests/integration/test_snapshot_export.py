"""State that survives losing a node: `ps-admin snapshot export` copies a snapshot off its
daemons' disks into a directory (safetensors a torch user can read, and a manifest), and
`snapshot restore --from DIR` brings it back onto any daemons. A daemon SIGKILLed with its
disk deleted, and training resumes from the export bit for bit as if never interrupted, for
AdamW, for SGD with momentum (which could not be restored before) and for LAMB. An interrupted export
resumes keeping what it wrote; a damaged file is found before anything is restored."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ps_offload import trainer
from tests.helpers.admin_cli import admin_json, run_admin
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

OPTIMIZERS = {
    "adamw": (lambda: trainer.AdamW(lr=1e-2, weight_decay=0.1), ["master", "exp_avg", "exp_avg_sq"]),
    "sgd-momentum": (lambda: trainer.SGD(lr=0.05, momentum=0.9, weight_decay=0.01), ["master", "momentum_buffer"]),
    # Whole parameters: restored onto another shard size, the plan packs them anew.
    "lamb": (lambda: trainer.LAMB(lr=1e-2, weight_decay=0.1), ["master", "exp_avg", "exp_avg_sq"]),
}


@pytest.mark.parametrize("which", OPTIMIZERS)
def test_a_node_lost_with_its_disk_resumes_from_the_export_bit_for_bit(tmp_path, which):
    optimizer, tensors = OPTIMIZERS[which]
    batches = teacher_batches()
    sources = [nvme_daemon(tmp_path, f"src{i}") for i in range(2)]
    targets = []
    shared = tmp_path / "shared" / "cut"  # another host's storage
    try:
        model = fresh_mlp()
        with offload_mlp(model, [d.address for d in sources], 4096, optimizer) as opt:  # 2 daemons, 4 shards
            for batch in batches[:CUT]:
                train_step(opt, model, batch)
            opt.synchronize()
            at_cut = {name: p.detach().clone() for name, p in model.named_parameters()}
            admin_json("snapshot", "take", "model", "cut", *daemon_args(sources[0]))
            exported = admin_json(
                "snapshot", "export", "model", "cut", "--out", str(shared), "--part-bytes", "16384",
                *daemon_args(sources[0]),
            )  # fmt: skip
            assert (exported["step"], exported["parts_written"]) == (CUT, exported["parts"])
            assert exported["parts"] >= 2 and exported["files"] == exported["parts"] * len(tensors)
            for batch in batches[CUT:]:  # the run goes on past the snapshot
                train_step(opt, model, batch)
            opt.synchronize()
        uninterrupted = copy.deepcopy(model)

        # A torch user reads the export without ps-offload: the parameters at the snapshot's step.
        manifest = json.loads((shared / "manifest.json").read_text())
        assert manifest["tensors"] == tensors and manifest["step"] == CUT
        read = {}
        for file in sorted(shared.glob("master-*.safetensors")):
            read.update(load_file(file))
        assert read.keys() == at_cut.keys()
        assert all(torch.equal(read[name], at_cut[name]) for name in at_cut)

        # The node of daemon 1 is lost: the process killed, its disk gone.
        sources[1].kill()
        shutil.rmtree(sources[1].workdir / "nvme")
        targets.append(nvme_daemon(tmp_path, "dst"))
        restored = admin_json(
            "snapshot", "restore", "model", "cut", "--from", str(shared), "--to", targets[0].address,
            "--shard-bytes", "8192",
        )  # fmt: skip
        assert (restored["step"], restored["shards_restored"]) == (CUT, restored["shards"])
        resumes_as_uninterrupted(targets[0].address, 8192, batches, uninterrupted, optimizer)
    finally:
        for daemon in sources + targets:
            daemon.kill()


def test_sgd_with_momentum_restores_from_its_daemons_too(tmp_path):
    """The daemon-to-daemon restore refused SGD with momentum ("whose buffer a restore cannot
    carry yet"); its buffer now travels as the snapshot's state."""
    optimizer, _ = OPTIMIZERS["sgd-momentum"]
    batches = teacher_batches()
    source, target = nvme_daemon(tmp_path, "src"), nvme_daemon(tmp_path, "dst")
    try:
        model = fresh_mlp()
        with offload_mlp(model, [source.address], 4096, optimizer) as opt:
            for batch in batches[:CUT]:
                train_step(opt, model, batch)
            opt.synchronize()
            admin_json("snapshot", "take", "model", "cut", "--daemon", source.address)
            for batch in batches[CUT:]:
                train_step(opt, model, batch)
            opt.synchronize()
        admin_json("snapshot", "restore", "model", "cut", "--to", target.address, "--daemon", source.address)
        resumes_as_uninterrupted(target.address, 4096, batches, copy.deepcopy(model), optimizer)
    finally:
        source.kill()
        target.kill()


def test_an_interrupted_export_resumes_and_a_damaged_one_restores_nothing(tmp_path):
    optimizer, _ = OPTIMIZERS["adamw"]
    source, target = nvme_daemon(tmp_path, "src"), nvme_daemon(tmp_path, "dst")
    out = tmp_path / "export"
    try:
        model = fresh_mlp()
        with offload_mlp(model, [source.address], 4096, optimizer) as opt:
            train_step(opt, model, teacher_batches()[0])
            opt.synchronize()
        admin_json("snapshot", "take", "model", "s", "--daemon", source.address)
        export = ["snapshot", "export", "model", "s", "--out", str(out), "--part-bytes", "16384"]
        first = admin_json(*export, "--daemon", source.address)
        manifest = json.loads((out / "manifest.json").read_text())
        # Interrupted: the manifest (written last) and one part's files are missing.
        (out / "manifest.json").unlink()
        lost = {file.name: load_file(file) for file in out.glob("*-00002-of-*.safetensors")}
        for name in lost:
            (out / name).unlink()
        refused = run_admin("snapshot", "restore", "model", "s", "--from", str(out), "--to", target.address)
        assert refused.returncode == 1 and "has no manifest.json" in refused.stderr
        again = admin_json(*export, "--daemon", source.address)
        assert (again["parts"], again["parts_written"]) == (first["parts"], 1)
        resumed = json.loads((out / "manifest.json").read_text())
        # The same export: the kept parts untouched, the lost one written again with the same
        # values (safetensors may order its header differently, so not compared byte for byte).
        assert {k: v for k, v in resumed.items() if k != "files"} == {k: v for k, v in manifest.items() if k != "files"}
        assert {f: e for f, e in resumed["files"].items() if f not in lost} == {
            f: e for f, e in manifest["files"].items() if f not in lost
        }
        for name, tensors in lost.items():
            again_read = load_file(out / name)
            assert again_read.keys() == tensors.keys() and all(torch.equal(again_read[k], tensors[k]) for k in tensors)

        # One byte changed on the shared storage: found before anything is registered.
        damaged = next(out.glob("exp_avg_sq-00001-*.safetensors"))
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 1
        damaged.write_bytes(bytes(data))
        refused = run_admin("snapshot", "restore", "model", "s", "--from", str(out), "--to", target.address)
        assert refused.returncode == 1 and "is not the file the export wrote" in refused.stderr
        assert admin_json("models", "--daemon", target.address) == []
        wrong = run_admin("snapshot", "restore", "other", "s", "--from", str(out), "--to", target.address)
        assert wrong.returncode == 1 and "holds snapshot 's' of model 'model'" in wrong.stderr
    finally:
        source.kill()
        target.kill()
