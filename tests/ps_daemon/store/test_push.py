"""PushRequest's validation, and the store's guard for a kernel that fails midway (which
validation should make unreachable): the shard never keeps half a step under its old version."""

from __future__ import annotations

import math

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.errors import DataLoss, InvalidArgument
from ps_offload.daemon.model.spec import MAX_LR, ModelSpec, ParamSpec
from ps_offload.daemon.store.pull import PullRequest
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.daemon.tiers.nvme import PAGE, DirectIO, NvmeFiles
from ps_offload.optimizers import AdamW

NUMEL = 1024


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(lr=math.nan), "lr must be finite, got nan"),
        (dict(lr=-math.inf), "lr must be finite"),
        (dict(lr=-1e-9), "lr must be in [0, 1000]"),
        (dict(lr=MAX_LR * 1.0001), "lr must be in [0, 1000]"),
        (dict(step=-1), "step must be >= 0"),
        (dict(kind="weights"), "kind 'weights' is unknown"),
        (dict(dtype="float64"), "dtype float64 is not accepted"),
        (dict(kind="parameters", encoding="onebit"), "initial PARAMETERS must be RAW float32"),
        (dict(variance_frozen_at=1), "variance_frozen_at is for MOMENTUM pushes only, this is GRADIENT"),
    ],
)
def test_a_push_that_says_something_wrong_cannot_be_built(fields, message):
    with pytest.raises(InvalidArgument, match="push to shard 3") as info:
        PushRequest("m", 3, **(dict(step=0, kind="gradient", nbytes=4) | fields))
    assert message in str(info.value)


def test_the_bounds_themselves_are_accepted():
    for lr in (0.0, MAX_LR):
        assert PushRequest("m", 0, step=0, kind="gradient", lr=lr).lr == lr


def _store(tmp_path=None) -> ShardStore:
    files = None
    if tmp_path is not None:
        files = NvmeFiles(tmp_path, io=DirectIO(threads=2, block_bytes=PAGE), fsync=False, spare_slots=1)
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=NUMEL * 4, files=files)
    store.registry.register(ModelSpec("m", (ParamSpec("w", (NUMEL,)),), AdamW(lr=0.1), NUMEL * 4, ("d",)), 0)
    store.push(PushRequest("m", 0, step=0, kind="parameters", data=torch.ones(NUMEL)))
    store.push(PushRequest("m", 0, step=0, kind="gradient", data=torch.linspace(-1, 1, NUMEL)))
    return store


def _failing_midway(monkeypatch, store: ShardStore) -> None:
    shard = store.registry.shard("m", 0)
    real = shard.optimizer.apply

    def apply(master, grad, lr, groups=(), *, multiplier=None, out=None):
        real(master, grad, lr, groups, multiplier=multiplier, out=out)  # the step, the state, the pull change
        master.fill_(math.inf)
        raise RuntimeError("injected")

    monkeypatch.setattr(shard.optimizer, "apply", apply)


def test_a_failed_update_goes_back_to_the_committed_version_on_nvme(monkeypatch, tmp_path):
    store = _store(tmp_path)
    shard = store.registry.shard("m", 0)
    before = [t.clone() for t in (shard.master, *shard.optimizer.state)]
    _failing_midway(monkeypatch, store)
    with pytest.raises(RuntimeError, match="injected"):
        store.push(PushRequest("m", 0, step=1, kind="gradient", data=torch.ones(NUMEL)))
    monkeypatch.undo()
    assert shard.version == 1 and shard.optimizer.step.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, (shard.master, *shard.optimizer.state), strict=True))
    assert store.push(PushRequest("m", 0, step=1, kind="gradient", data=torch.ones(NUMEL))).version == 2
    store.close()
    store.files.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_push_carrying_its_pull_writes_the_new_version_there_and_on_failure_the_old(dtype, monkeypatch, tmp_path):
    """pull_into (the local transport's): the new master values as a pull in that dtype gives
    them, written in the update's own pass; when the update fails, the values the shard went
    back to, so the trainer never keeps a version that was not committed."""
    store = _store(tmp_path)
    shard = store.registry.shard("m", 0)
    target = torch.full((NUMEL,), 9.0, dtype=dtype)
    result = store.push(PushRequest("m", 0, step=1, kind="gradient", data=torch.ones(NUMEL)), pull_into=target)
    assert result.applied and result.pulled and result.version == 2
    assert torch.equal(target, shard.master.to(dtype))
    committed = shard.master.clone()
    _failing_midway(monkeypatch, store)
    target.fill_(9.0)
    with pytest.raises(RuntimeError, match="injected"):
        store.push(PushRequest("m", 0, step=2, kind="gradient", data=torch.ones(NUMEL)), pull_into=target)
    monkeypatch.undo()
    assert torch.equal(shard.master, committed) and torch.equal(target, committed.to(dtype))
    duplicate = store.push(PushRequest("m", 0, step=1, kind="gradient", data=torch.ones(NUMEL)), pull_into=target)
    assert not duplicate.applied and not duplicate.pulled  # the trainer pulls as usual
    store.close()
    store.files.close()


def test_a_failed_update_without_nvme_takes_the_shard_out_of_use(monkeypatch):
    store = _store()
    _failing_midway(monkeypatch, store)
    with pytest.raises(RuntimeError, match="injected"):
        store.push(PushRequest("m", 0, step=1, kind="gradient", data=torch.ones(NUMEL)))
    with pytest.raises(DataLoss, match="an update failed midway"):
        store.push(PushRequest("m", 0, step=1, kind="gradient", data=torch.ones(NUMEL)))
    with pytest.raises(DataLoss):
        with store.pull(PullRequest("m", 0), timeout=1):
            pass
