"""Master pulls of shards that are not in RAM, in the store on real files: read from the
committed slot's master region without loading the shard, the same bytes as from RAM, one
committed version even while updates race them, DATA_LOSS for a bad region, format 2 slots
loaded whole as before, and the residency and counters of the RAM tier left alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.errors import DataLoss, DeadlineExceeded, FailedPrecondition
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.store import tier_admin
from ps_offload.daemon.store.pull import PullRequest
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.shard import arena_nbytes
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.daemon.tiers.nvme import PAGE, DirectIO, NvmeFiles
from ps_offload.optimizers import AdamW
from tests.helpers.nvme_files import downgrade_to_format_2
from tests.helpers.specs import register_in_store

NUMEL = 1024  # one 4 KiB page of master values per shard; AdamW's arena is 14 KiB
SHARDS = 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _store(directory, *, files: NvmeFiles | None = None, ram_shards: int = 2) -> ShardStore:
    """Room in RAM for `ram_shards` of the 3 shards; no learned prefetch, so that nothing but
    the test moves a shard between the tiers. `directory` None: RAM only."""
    if files is None and directory is not None:
        files = NvmeFiles(directory, io=DirectIO(threads=2, block_bytes=PAGE), fsync=False, spare_slots=1)
    ram = ram_shards * arena_nbytes(NUMEL, AdamW()) if files is not None else 1 << 30
    return open_store(ram_bytes=ram, default_shard_bytes=NUMEL * 4, files=files, prefetch_depth=0)


def _register(store: ShardStore) -> None:
    register_in_store(store, shards=SHARDS, numel=NUMEL)


def _gradient(shard_id: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * shard_id + step))


def _step(store: ShardStore, shard_id: int) -> None:
    step = store.registry.shard("m", shard_id).version
    store.push(PushRequest("m", shard_id, step=step, kind="gradient", data=_gradient(shard_id, step), lr=None))


def _trained(tmp_path, **kwargs) -> ShardStore:
    store = _store(tmp_path, **kwargs)
    _register(store)
    for shard_id in range(SHARDS):
        _step(store, shard_id)
    return store


def _close(store: ShardStore) -> None:
    store.close()
    if store.files is not None:
        store.files.close()


def _pull(store: ShardStore, shard_id: int, dtype: str = "float32", **kwargs) -> tuple[torch.Tensor, int]:
    pull = PullRequest("m", shard_id, min_version=kwargs.pop("min_version", 0), dtype=dtype)
    with store.pull(pull, timeout=5, **kwargs) as (values, version):
        return values.clone(), version


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.uint8)


def _tiers(store: ShardStore) -> list[str]:
    return [store.registry.shard("m", s).tier for s in range(SHARDS)]


def _tier_use(store: ShardStore) -> tuple:
    s = store.stats_snapshot()
    return store.tier.used, store.tier.pooled, s.tier_hits, s.tier_misses, s.evictions, s.prefetched


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_an_evicted_shard_pulls_the_bytes_it_has_in_ram_and_stays_on_nvme(tmp_path, dtype):
    store = _trained(tmp_path)
    pool = StagingPool(max_bytes=1 << 20)
    try:
        assert _tiers(store) == ["nvme", "ram", "ram"]  # the tier holds two: shard 0 went first
        tier_use, stats = _tier_use(store), store.stats_snapshot()

        from_disk, version = _pull(store, 0, dtype, scratch=pool.borrow)
        assert version == 1 and from_disk.dtype == DTYPES[dtype] and from_disk.numel() == NUMEL
        # Not made resident: no room taken, nobody evicted, no hit or miss.
        assert _tiers(store) == ["nvme", "ram", "ram"] and _tier_use(store) == tier_use
        after = store.stats_snapshot()
        assert (after.nvme_master_reads, after.nvme_master_bytes_read) == (1, PAGE)
        assert after.nvme_bytes_read - stats.nvme_bytes_read == PAGE  # a third of what a load reads
        assert after.pulls == stats.pulls + 1
        assert after.bytes_pulled - stats.bytes_pulled == NUMEL * DTYPES[dtype].itemsize

        tier_admin.load(store, "m", 0)
        from_ram, version = _pull(store, 0, dtype, scratch=pool.borrow)
        assert version == 1 and torch.equal(_bits(from_ram), _bits(from_disk))
        assert store.stats_snapshot().nvme_master_reads == 1  # from RAM now
    finally:
        _close(store)


def test_a_resident_shard_is_pulled_from_ram_and_other_tensors_load_the_shard(tmp_path):
    store = _trained(tmp_path)
    try:
        hits, misses = store.stats_snapshot().tier_hits, store.stats_snapshot().tier_misses
        _pull(store, 2)
        assert store.stats_snapshot().tier_hits == hits + 1 and store.stats_snapshot().nvme_master_reads == 0
        # Optimizer state is pulled to resume from, rarely: it loads the shard as before.
        with store.pull(PullRequest("m", 0, tensor="exp_avg"), timeout=5) as (exp_avg, version):
            assert version == 1 and torch.count_nonzero(exp_avg) > 0
        assert store.registry.shard("m", 0).tier == "ram" and store.stats_snapshot().tier_misses == misses + 1
        assert store.stats_snapshot().nvme_master_reads == 0
    finally:
        _close(store)


def test_the_read_ends_the_hold_and_its_buffer_comes_from_the_pool_and_goes_back(tmp_path):
    store = _trained(tmp_path)
    pool = StagingPool(max_bytes=1 << 20)
    shard = store.registry.shard("m", 0)
    try:
        with store.pull(PullRequest("m", 0), timeout=5, scratch=pool.borrow) as (sent, version):
            # Sent from this pull's copy: an update goes ahead meanwhile and does not change it.
            assert shard.readers == 0 and pool.idle_bytes == 0
            before = sent.clone()
            _step(store, 0)
            assert shard.version == 2 and torch.equal(_bits(sent), _bits(before)) and version == 1
            buffer = sent.data_ptr()
        assert pool.idle_bytes == PAGE + PAGE  # the region and the page it may start into
        tier_admin.evict(store, "m", 0)
        with store.pull(PullRequest("m", 0), timeout=5, scratch=pool.borrow) as (sent, version):
            assert sent.data_ptr() == buffer and version == 2  # the same buffer, not a new one
            assert sent.data_ptr() % PAGE == 0
    finally:
        _close(store)


def test_a_commit_waits_for_the_read_and_other_commits_cannot_take_its_slot(tmp_path, monkeypatch):
    """The disk read holds the shard, so its next commit (the one thing that frees the slot
    being read) waits for it; other shards commit meanwhile through the one spare slot and
    never into the slot being read. The pull gets the version it reports."""
    store = _trained(tmp_path, ram_shards=SHARDS)
    files = store.files
    expected = store.registry.shard("m", 2).master.clone()
    tier_admin.evict(store, "m", 2)
    committed = files.committed_slot("m", 2)
    reading, release, pulled = threading.Event(), threading.Event(), []
    real_read = files.io.read

    def read(fd, view, offset, **kwargs):
        if threading.current_thread() is puller:
            reading.set()
            assert release.wait(10)
        real_read(fd, view, offset, **kwargs)

    monkeypatch.setattr(files.io, "read", read)
    puller = threading.Thread(target=lambda: pulled.append(_pull(store, 2)))
    pusher = threading.Thread(target=_step, args=(store, 2))
    try:
        puller.start()
        assert reading.wait(10)
        pusher.start()
        for _ in range(3):  # each frees a slot the next one takes
            _step(store, 0)
            _step(store, 1)
            assert files.committed_slot("m", 2) is committed and committed[0] not in files.files["m"].free
        time.sleep(0.2)
        assert pusher.is_alive() and store.registry.shard("m", 2).version == 1
        release.set()
        puller.join(10)
        pusher.join(10)
        assert not puller.is_alive() and not pusher.is_alive()
        ((values, version),) = pulled
        assert version == 1 and torch.equal(_bits(values), _bits(expected))
        assert store.registry.shard("m", 2).version == 2 and store.stats_snapshot().nvme_master_reads == 1
    finally:
        release.set()
        _close(store)


def test_pulls_racing_updates_and_evictions_get_one_committed_version(tmp_path):
    steps = 12
    reference = _store(None)  # RAM only: the master values of every version
    _register(reference)
    expected = [reference.registry.shard("m", 0).master.clone()]
    for _ in range(steps):
        _step(reference, 0)
        expected.append(reference.registry.shard("m", 0).master.clone())

    store = _store(tmp_path, ram_shards=1)
    _register(store)
    done, pulled, errors = threading.Event(), [], []

    def push() -> None:
        for _ in range(steps):
            _step(store, 0)  # loads the shard if it is on NVMe
            while True:  # and back to NVMe only: the pulls until the next push read from disk
                try:
                    tier_admin.evict(store, "m", 0)
                    break
                except FailedPrecondition:  # pinned by a pull from RAM
                    time.sleep(0.001)
            time.sleep(0.01)
        done.set()

    def pull(dtype: str) -> None:
        try:
            while not done.is_set():
                pulled.append((dtype, *_pull(store, 0, dtype)))
                time.sleep(0.0005)  # room for the eviction
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=push)]
    threads += [threading.Thread(target=pull, args=(d,)) for d in ("float32", "bfloat16")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads)
        for dtype, values, version in pulled:
            assert torch.equal(_bits(values), _bits(expected[version].to(DTYPES[dtype]))), (dtype, version)
        assert len({version for _, _, version in pulled}) > steps // 2
        assert store.stats_snapshot().nvme_master_reads > steps // 2  # read from disk, most of them
    finally:
        _close(store)
        _close(reference)


def test_a_pull_for_a_version_not_committed_yet_waits_for_it(tmp_path):
    store = _trained(tmp_path)
    try:
        assert store.registry.shard("m", 0).tier == "nvme"
        with pytest.raises(DeadlineExceeded, match="waited for version 2"):
            with store.pull(PullRequest("m", 0, min_version=2), timeout=0.2):
                pass
        pulled = []
        waiting = threading.Thread(target=lambda: pulled.append(_pull(store, 0, min_version=2)))
        waiting.start()
        time.sleep(0.2)
        assert not pulled
        _step(store, 0)
        waiting.join(10)
        ((values, version),) = pulled
        assert version == 2 and torch.equal(values, store.registry.shard("m", 0).master)
    finally:
        _close(store)


def test_a_corrupt_master_region_is_data_loss_for_that_shard_only(tmp_path):
    store = _trained(tmp_path, ram_shards=1)
    try:
        assert _tiers(store) == ["nvme", "nvme", "ram"]
        slot, _ = store.files.committed_slot("m", 0)
        with open(tmp_path / "m.arena", "r+b") as f:  # one byte of shard 0's master values
            at = store.files.files["m"].offset(slot) + PAGE + 100
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0xFF]))
        with pytest.raises(DataLoss, match="shard 0 of model 'm' is corrupt on disk .*master values"):
            _pull(store, 0)
        with pytest.raises(DataLoss, match="shard 0 of model 'm' is corrupt"):  # and stays refused
            _pull(store, 0, "bfloat16")
        assert store.registry.shard("m", 1).tier == "nvme" and store.stats_snapshot().shards_corrupt == 1
        assert _pull(store, 1)[1] == 1 and _pull(store, 2)[1] == 1  # on NVMe, and in RAM
        assert store.stats_snapshot().nvme_master_reads == 1  # shard 1's; the failed read is not counted
    finally:
        _close(store)


def test_a_slot_of_format_2_loads_the_shard_whole_until_its_next_commit(tmp_path):
    store = _trained(tmp_path)
    before = tier_admin.load(store, "m", 0).master.clone()
    _close(store)
    downgrade_to_format_2(tmp_path)

    store = _store(tmp_path)
    try:
        assert store.registry.recover() == SHARDS and _tiers(store) == ["nvme"] * SHARDS
        values, version = _pull(store, 0)
        assert version == 1 and torch.equal(values, before)
        stats = store.stats_snapshot()
        assert (stats.nvme_master_reads, stats.tier_misses) == (0, 1) and store.registry.shard("m", 0).tier == "ram"
        _step(store, 0)  # committed in format 3
        tier_admin.evict(store, "m", 0)
        values, version = _pull(store, 0)
        assert (
            version == 2
            and store.stats_snapshot().nvme_master_reads == 1
            and store.registry.shard("m", 0).tier == "nvme"
        )
    finally:
        _close(store)


def test_after_a_restart_the_shards_are_pulled_from_disk_as_they_were(tmp_path):
    store = _trained(tmp_path, ram_shards=SHARDS)
    before = [store.registry.shard("m", s).master.clone() for s in range(SHARDS)]
    _close(store)
    store = _store(tmp_path)
    try:
        assert store.registry.recover() == SHARDS
        for shard_id in range(SHARDS):
            values, version = _pull(store, shard_id, "float32")
            assert version == 1 and torch.equal(_bits(values), _bits(before[shard_id]))
        assert store.stats_snapshot().nvme_master_reads == SHARDS and _tiers(store) == ["nvme"] * SHARDS
        _step(store, 1)  # and training goes on from there
        assert store.registry.shard("m", 1).version == 2
    finally:
        _close(store)
