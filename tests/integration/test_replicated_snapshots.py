"""Snapshots of a replicated model (OffloadConfig(replicas=2)) need one live holder of each
shard, as exports do: with a daemon lost for good, `ps-admin snapshot take` takes the cut on
the holders left (showing the lost one as not taken), and export and restore read each shard
from a holder that has it. A restore onto daemons of a replicated model writes every replica,
and training resumed there ends bit for bit where torch.optim.AdamW(fused=True) ends."""

from __future__ import annotations

from tests.helpers.admin_cli import admin_json, run_admin
from tests.helpers.persistence_run import (
    assert_same_parameters,
    classifier_case,
    classifier_loss,
    fused_adamw_reference,
)
from tests.helpers.replication import lose_for_good, nvme_daemons, offload_replicated, replicas_report

STEPS, LOST_AT, CUT = 10, 2, 5


def _train(opt, model, batches) -> None:
    for batch in batches:
        opt.zero_grad()
        classifier_loss(model, batch).backward()
        opt.step()


def _take_with_a_holder_lost(daemon_factory, tmp_path):
    """Trains on 3 daemons, loses one for good at LOST_AT, takes snapshot "cut" at CUT on the
    holders left and trains on to STEPS; returns (the daemons, torch's parameters after STEPS,
    the batches)."""
    model, batches = classifier_case()
    batches = batches[:STEPS]
    reference = fused_adamw_reference(model, batches)
    daemons, dirs = nvme_daemons(daemon_factory, tmp_path)
    with offload_replicated(model, daemons) as opt:
        _train(opt, model, batches[:LOST_AT])
        lose_for_good(daemons[1], dirs[1])
        _train(opt, model, batches[LOST_AT:CUT])
        opt.synchronize()
        assert set(opt.client.holders.lost) == {1}
        taken = admin_json("snapshot", "take", "model", "cut", "--daemon", daemons[0].address)
        by_daemon = {r["daemon"]: r for r in taken}
        assert by_daemon[daemons[1].address]["missing"] and not by_daemon[daemons[1].address]["complete"]
        assert all(
            by_daemon[d.address]["complete"] and by_daemon[d.address]["step"] == CUT for d in (daemons[0], daemons[2])
        )
        listed = run_admin("snapshot", "list", "model", "--daemon", daemons[0].address)
        assert listed.returncode == 0 and "not on this holder" in listed.stdout, listed.stderr
        _train(opt, model, batches[CUT:])  # the run goes on past the cut
        opt.synchronize()
    assert_same_parameters(model, reference)
    return daemons, reference, batches


def _restore_and_resume(daemon_factory, tmp_path, source: list[str], reference, batches) -> None:
    """Restores "cut" from `source` (ps-admin flags) onto 3 fresh daemons: every replica
    written at one version, and training resumed there ends where torch's does."""
    targets = daemon_factory.together([("--nvme-dir", str(tmp_path / f"to{i}"), "--create-nvme-dir") for i in range(3)])
    addresses = [flag for d in targets for flag in ("--to", d.address)]
    restored = admin_json("snapshot", "restore", "model", "cut", *addresses, *source)
    assert restored["step"] == CUT
    report = replicas_report(targets[0].address)  # every replica written, at one version
    assert report["degraded"] == 0 and all(h["version"] == CUT for r in report["shards"] for h in r["holders"])
    resumed, _ = classifier_case()
    with offload_replicated(resumed, targets) as opt:
        assert opt.step_count == CUT
        _train(opt, resumed, batches[CUT:])
        opt.synchronize()
    assert_same_parameters(resumed, reference)


def test_a_snapshot_with_a_holder_lost_is_taken_and_restored_from_its_holders(daemon_factory, tmp_path):
    daemons, reference, batches = _take_with_a_holder_lost(daemon_factory, tmp_path)
    _restore_and_resume(daemon_factory, tmp_path, ["--daemon", daemons[0].address], reference, batches)


def test_a_snapshot_with_a_holder_lost_is_exported_and_restored_from_the_export(daemon_factory, tmp_path):
    daemons, reference, batches = _take_with_a_holder_lost(daemon_factory, tmp_path)
    exported = admin_json("snapshot", "export", "model", "cut", "--out", str(tmp_path / "export"),
                          "--daemon", daemons[0].address)  # fmt: skip
    assert exported["step"] == CUT
    _restore_and_resume(daemon_factory, tmp_path, ["--from", str(tmp_path / "export")], reference, batches)


def test_a_snapshot_no_live_holder_of_a_shard_can_take_is_refused_and_left_nowhere(daemon_factory, tmp_path):
    """Two of three daemons gone: some shards have no holder left, so the take fails naming them,
    and the holder that took its part deletes it again (all or none)."""
    model, batches = classifier_case()
    daemons, dirs = nvme_daemons(daemon_factory, tmp_path)
    with offload_replicated(model, daemons) as opt:
        _train(opt, model, batches[:2])
        opt.synchronize()
    for index in (1, 2):
        lose_for_good(daemons[index], dirs[index])
    flags = [flag for d in daemons for flag in ("--daemon", d.address)]
    refused = run_admin("snapshot", "take", "model", "cut", *flags)
    assert refused.returncode == 1 and "no holder of shards" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    listed = admin_json("snapshot", "list", "model", *flags)
    assert not [r for r in listed if r["name"] == "cut"], listed
