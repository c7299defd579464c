"""The store's side of the Admin service on real files: verify reads committed slots back
without disturbing anything, and is not fooled by commits that land during its reads;
value statistics carry a histogram of the finite values."""

from __future__ import annotations

import math

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.errors import NotFound
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
from ps_offload.daemon.store import inspection, tier_admin
from ps_offload.daemon.store.inspection import VERIFY_ATTEMPTS
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.daemon.tiers.nvme import PAGE, DirectIO, NvmeFiles
from ps_offload.optimizers import SGD

NUMEL = 1024  # one 4 KiB shard of fp32 per 1024 elements


def _store(tmp_path=None, *, shards: int = 2) -> ShardStore:
    files = None
    if tmp_path is not None:
        # One spare slot: the slot a commit frees is the very next commit's.
        files = NvmeFiles(tmp_path, io=DirectIO(threads=2, block_bytes=PAGE), fsync=False, spare_slots=1)
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=NUMEL * 4, files=files)
    spec = ModelSpec("m", (ParamSpec("w", (shards * NUMEL,)),), SGD(lr=0.1), NUMEL * 4, ("d",))
    store.registry.register(spec, 0)
    for shard_id in range(shards):
        store.push(
            PushRequest("m", shard_id, step=0, kind="parameters", data=torch.full((NUMEL,), float(shard_id)), lr=None)
        )
    return store


def _step(store: ShardStore, shard_id: int) -> None:
    version = store.registry.shard("m", shard_id).version
    store.push(PushRequest("m", shard_id, step=version, kind="gradient", data=torch.ones(NUMEL), lr=None))


def _close(store: ShardStore) -> None:
    store.close()
    store.files.close()


def _interleave(monkeypatch, store: ShardStore, commits_during: int) -> list[int]:
    """Makes each of the first `commits_during` slot checks start only after shard 0 and
    then shard 1 committed a new version: shard 0's commit frees the slot the check is
    about to read, and shard 1's commit writes its own version into it. Returns, per check,
    how many readers held shard 0 during it."""
    real, readers = store.files.check_slot, []

    def check_slot(model, slot, expected, buffer):
        if len(readers) < commits_during:
            _step(store, 0)
            _step(store, 1)
        readers.append(store.registry.shard("m", 0).readers)
        return real(model, slot, expected, buffer)

    monkeypatch.setattr(store.files, "check_slot", check_slot)
    return readers


def test_verify_reads_every_committed_shard_back_and_leaves_the_tiers_alone(tmp_path):
    store = _store(tmp_path, shards=3)
    try:
        _step(store, 1)
        assert tier_admin.evict(store, "m", 2).tier == "nvme"
        read_before = store.files.bytes_read
        shards = inspection.shards_to_verify(store, "m")
        assert inspection.verify_bytes(store.files, shards) == 3 * (PAGE + store.registry.shard("m", 0).arena_bytes)
        verdicts = list(inspection.verify(store.files, shards))
        assert [(v.shard_id, v.status, v.version, v.tier) for v in verdicts] == [
            (0, "ok", 0, "ram"), (1, "ok", 1, "ram"), (2, "ok", 0, "nvme"),
        ]  # fmt: skip
        assert all(v.bytes_read == PAGE + store.registry.shard("m", 0).arena_bytes for v in verdicts)
        # Nothing was loaded: shard 2 is still on NVMe, and the tier read nothing.
        assert store.registry.shard("m", 2).tier == "nvme" and store.files.bytes_read == read_before
    finally:
        _close(store)


def test_a_commit_during_the_read_is_not_reported_bad(tmp_path, monkeypatch):
    store = _store(tmp_path)
    try:
        readers = _interleave(monkeypatch, store, commits_during=1)
        verdict = next(inspection.verify(store.files, inspection.shards_to_verify(store, "m")))
        # The first read found shard 1's new version in shard 0's old slot; it did not count,
        # and the second read, of shard 0's new slot, passed.
        assert (verdict.shard_id, verdict.status, verdict.version) == (0, "ok", 1), verdict.detail
        assert readers == [0, 0]  # both without holding the shard
    finally:
        _close(store)


def test_a_shard_committed_during_every_read_is_held_still_for_the_last(tmp_path, monkeypatch):
    store = _store(tmp_path)
    try:
        readers = _interleave(monkeypatch, store, commits_during=VERIFY_ATTEMPTS)
        verdict = next(inspection.verify(store.files, inspection.shards_to_verify(store, "m")))
        assert (verdict.status, verdict.version) == ("ok", VERIFY_ATTEMPTS), verdict.detail
        assert readers == [0] * VERIFY_ATTEMPTS + [1]  # the last read under a read hold, as a pull's
        assert store.registry.shard("m", 0).readers == 0  # and released
    finally:
        _close(store)


def test_verify_names_a_shard_that_was_never_committed(tmp_path):
    store = _store(tmp_path)
    try:
        spec = ModelSpec("fresh", (ParamSpec("w", (NUMEL,)),), SGD(lr=0.1), NUMEL * 4, ("d",))
        store.registry.register(spec, 0)
        (verdict,) = inspection.verify(store.files, inspection.shards_to_verify(store, "fresh"))
        assert verdict.status == "not_at_rest" and "never pushed" in verdict.detail
        every_shard = inspection.shards_to_verify(store)
        assert [v.model for v in inspection.verify(store.files, every_shard)] == ["fresh", "m", "m"]
    finally:
        _close(store)


def test_verify_without_nvme_checks_memory_and_says_nothing_is_at_rest():
    store = _store()
    values = torch.zeros(NUMEL)
    values[[3, 5]] = torch.tensor([math.nan, math.inf])
    store.push(PushRequest("m", 1, step=0, kind="parameters", data=values, lr=None))
    assert inspection.verify_bytes(store.files, inspection.shards_to_verify(store)) == 0
    verdicts = list(inspection.verify(store.files, inspection.shards_to_verify(store)))
    assert [(v.status, v.nonfinite, v.bytes_read) for v in verdicts] == [("not_at_rest", 0, 0), ("not_at_rest", 2, 0)]
    assert all("nothing at rest" in v.detail for v in verdicts)
    assert "2 non-finite" in verdicts[1].detail


def test_histogram_counts_finite_values_in_equal_bins():
    store = _store(shards=1)
    values = torch.arange(NUMEL, dtype=torch.float32)
    values[:2] = torch.tensor([math.nan, -math.inf])
    store.push(PushRequest("m", 0, step=0, kind="parameters", data=values, lr=None))
    stats = inspection.value_stats(store, store.registry.shard("m", 0), bins=4)
    assert (stats.histogram_low, stats.histogram_high) == (2.0, NUMEL - 1.0)
    assert sum(stats.histogram) == NUMEL - 2 and len(stats.histogram) == 4
    assert stats.histogram == tuple(int(c) for c in torch.histc(values[2:].double(), 4, 2.0, NUMEL - 1.0))
    assert stats.nan_count == 1 and stats.min == -math.inf  # min/max keep the infinities
    assert inspection.value_stats(store, store.registry.shard("m", 0)).histogram == ()  # only when asked for

    store.push(PushRequest("m", 0, step=0, kind="parameters", data=torch.full((NUMEL,), 0.5), lr=None))
    one = inspection.value_stats(store, store.registry.shard("m", 0), bins=4)
    assert (one.histogram, one.histogram_low, one.histogram_high) == ((NUMEL,), 0.5, 0.5)

    store.push(PushRequest("m", 0, step=0, kind="parameters", data=torch.full((NUMEL,), math.nan), lr=None))
    assert inspection.value_stats(store, store.registry.shard("m", 0), bins=4).histogram == ()


def test_verify_of_an_unknown_model_names_the_known_ones():
    with pytest.raises(NotFound, match=r"'nope' is not registered on this daemon \(registered: m\)"):
        inspection.shards_to_verify(_store(), "nope")
