"""A damaged newest slot header never rolls a shard back in silence: after a bit flipped in
it, or the block zeroed, the restarted daemon answers DATA_LOSS for that shard (naming it and
both versions), `ps-admin verify` calls it bad, the other shards serve, and moving the
versions record away is the operator's explicit way to accept the older version."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from ps_offload.daemon.local import LocalDaemon
from ps_offload.daemon.tiers.nvme import PAGE, SlotHeader
from ps_offload.daemon.tiers.version_floors import VersionFloors
from ps_offload.proto.pull import Pull
from ps_offload.trainer.wire.daemon_client import DaemonClient
from tests.helpers.admin_cli import admin_json, run_admin, verify_verdicts
from tests.helpers.nvme_files import committed_slot, flip_byte
from tests.helpers.training import train_linear

STEPS = 3
DAMAGED_SHARD = 1


def _start(tmp_path: Path, name: str) -> LocalDaemon:
    return LocalDaemon(tmp_path / name, "--nvme-dir", str(tmp_path / "nvme"))


def _damage_newest_header(nvme: Path, how: str) -> None:
    arena = next(nvme.glob("*.arena"))
    at = committed_slot(nvme, DAMAGED_SHARD)
    if how == "flip":
        flip_byte(arena, at + 30)  # a byte of the header's body: its crc32c fails
    else:
        fd = os.open(arena, os.O_RDWR)
        try:
            os.pwrite(fd, bytes(PAGE), at)
            os.fsync(fd)
        finally:
            os.close(fd)
    # The shard's previous version is still on disk in a freed slot, readable: without the
    # record, recovery would take it.
    assert SlotHeader.unpack(open(arena, "rb").read()[at : at + PAGE]) is None
    committed_slot(nvme, DAMAGED_SHARD)  # finds an older header (asserts one exists)


def _pull(client: DaemonClient, plan, shard_id: int) -> int:
    out = memoryview(bytearray(plan[shard_id].numel * 4))
    return client.pull_into(Pull.of("model", shard_id, min_version=0), out=out, timeout=10)


def _recorded(nvme: Path) -> dict[int, int]:
    floors, problem = VersionFloors.load(next(nvme.glob("*.versions")))
    assert problem == ""
    return {shard_id: floors.get(shard_id) for shard_id in range(3)}


@pytest.mark.parametrize("how", ["flip", "zero"])
def test_damaged_newest_header_is_data_loss_not_an_older_version(tmp_path, how):
    nvme = tmp_path / "nvme"
    first = _start(tmp_path, "a")
    try:
        plan = train_linear(first.address, STEPS)
    finally:
        assert first.stop() == 0  # a clean stop records every committed version
    assert _recorded(nvme) == {s.shard_id: STEPS for s in plan}
    _damage_newest_header(nvme, how)

    second = _start(tmp_path, "b")
    try:
        client = DaemonClient(second.address, max_message_bytes=8 << 20)
        with pytest.raises(grpc.RpcError) as info:
            _pull(client, plan, DAMAGED_SHARD)
        details = info.value.details()
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert f"shard {DAMAGED_SHARD} of model 'model'" in details
        assert f"version {STEPS} was committed" in details and f"version {STEPS - 1}" in details
        assert "model.versions" in details and "model.arena" in details
        assert f"shard {DAMAGED_SHARD} of model 'model'" in second.log()
        assert [_pull(client, plan, i) for i in (0, 2)] == [STEPS, STEPS]  # the others serve
        client.close()

        report = admin_json_allow_bad("verify", "--daemon", second.address)
        verdicts = verify_verdicts(report)
        assert (
            verdicts[DAMAGED_SHARD]["status"] == "bad"
            and "refused rather than rolled back" in (verdicts[DAMAGED_SHARD]["detail"])
        )
        assert [verdicts[i]["status"] for i in (0, 2)] == ["ok", "ok"]
        tiers = {r["shard_id"]: r["tier"] for r in admin_json("shards", "--daemon", second.address)}
        assert tiers[DAMAGED_SHARD] == "corrupt"
    finally:
        second.kill()

    # Restarted again it is still refused (the record was not lowered to what the disk shows).
    assert _recorded(nvme)[DAMAGED_SHARD] == STEPS
    # The operator accepts the older version by moving the record away, as the message says.
    next(nvme.glob("*.versions")).rename(tmp_path / "model.versions.moved")
    third = _start(tmp_path, "c")
    try:
        client = DaemonClient(third.address, max_message_bytes=8 << 20)
        assert _pull(client, plan, DAMAGED_SHARD) == STEPS - 1
        client.close()
    finally:
        third.kill()


def admin_json_allow_bad(*args: str) -> dict:
    """`ps-admin ... --json` that exits 1 for bad shards, still with its report on stdout."""
    result = run_admin(*args, "--json")
    assert result.returncode in (0, 1), result.stderr
    return json.loads(result.stdout)


def test_versions_are_recorded_while_running_so_a_sigkill_keeps_the_check(tmp_path):
    """Not only a clean stop records: within store.nvme_floor_seconds (1 s) of the last commit
    the record holds it, so a daemon SIGKILLed later still catches the damaged header."""
    nvme = tmp_path / "nvme"
    first = _start(tmp_path, "a")
    try:
        plan = train_linear(first.address, STEPS)
        deadline = time.monotonic() + 60
        while not (list(nvme.glob("*.versions")) and _recorded(nvme)[DAMAGED_SHARD] == STEPS):
            assert time.monotonic() < deadline, "the committed versions were not recorded within 60 s"
            time.sleep(0.05)  # the record is written by a timer; no event reaches the test
    finally:
        first.stop(signal.SIGKILL)
    _damage_newest_header(nvme, "flip")
    second = _start(tmp_path, "b")
    try:
        client = DaemonClient(second.address, max_message_bytes=8 << 20)
        with pytest.raises(grpc.RpcError) as info:
            _pull(client, plan, DAMAGED_SHARD)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        client.close()
    finally:
        second.kill()


def test_a_damaged_record_is_a_warning_and_every_shard_serves(tmp_path):
    nvme = tmp_path / "nvme"
    first = _start(tmp_path, "a")
    try:
        plan = train_linear(first.address, STEPS)
    finally:
        assert first.stop() == 0
    record = next(nvme.glob("*.versions"))
    flip_byte(record, 14)
    second = _start(tmp_path, "b")
    try:
        assert "model.versions is damaged (checksum mismatch)" in second.log()
        client = DaemonClient(second.address, max_message_bytes=8 << 20)
        assert [_pull(client, plan, s.shard_id) for s in plan] == [STEPS] * len(plan)
        client.close()
    finally:
        assert second.stop() == 0
    assert _recorded(nvme) == {s.shard_id: STEPS for s in plan}  # recorded afresh from the headers
