"""The slot allocator of the NVMe tier on a real file with O_DIRECT: versions move between
slots, the disk holds N + K slots and no more, and recovery finds each shard's newest
committed version even when freed slots were reused and torn by a crash."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

from ps_offload.daemon.model.spec import ModelSpec, ParamSpec, spec_from_dict, spec_to_dict
from ps_offload.daemon.tiers.nvme import (
    FORMAT_VERSION,
    PAGE,
    DirectIO,
    FileLayout,
    NoCapacity,
    NvmeFiles,
    SlotHeader,
    aligned_empty,
)
from ps_offload.optimizers import SGD

SHARDS = 4
ARENA = 3 * PAGE


def _files(directory, **kwargs) -> NvmeFiles:
    return NvmeFiles(directory, io=DirectIO(threads=2, block_bytes=PAGE), fsync=True, **kwargs)


def _spec(name: str = "m") -> ModelSpec:
    return ModelSpec(name, (ParamSpec("w", (SHARDS * 1024,)),), SGD(lr=0.1), 4096, ("d",))


def _arena(fill: int) -> memoryview:
    _, view = aligned_empty(ARENA)
    view[:] = bytes([fill]) * ARENA
    return view


def _commit(files: NvmeFiles, shard: int, version: int, model: str = "m") -> None:
    files.commit(model, shard, _arena(16 * shard + version), version=version, initialized=True, numel=1024)


def _reopen(directory) -> tuple[NvmeFiles, dict[int, SlotHeader]]:
    files = _files(directory)
    (spec, _, layout) = files.recorded_models(parse=spec_from_dict)[0]
    headers, rolled_back = files.open_model(spec, layout, set(range(SHARDS)))
    assert rolled_back == {}  # no header here is damaged after its version was recorded
    return files, headers


def _read(files: NvmeFiles, shard: int) -> bytes:
    _, out = aligned_empty(ARENA)
    files.load("m", shard, out)
    return bytes(out)


def test_file_holds_one_slot_per_shard_plus_spares(tmp_path):
    files = _files(tmp_path, spare_slots=2)
    layout = files.create_model(spec_to_dict(_spec()), 0, {i: ARENA for i in range(SHARDS)})
    assert layout == FileLayout(slot_bytes=PAGE + ARENA, slots=SHARDS + 2)
    assert (tmp_path / "m.arena").stat().st_size == layout.size
    # Never more spares than shards: a model of 1 shard has 2 slots.
    small = files.layout_for({0: ARENA})
    assert small.slots == 2
    files.close()


def test_recovery_takes_each_shards_newest_version_after_many_commits(tmp_path):
    files = _files(tmp_path, spare_slots=2)
    files.create_model(spec_to_dict(_spec()), 0, {i: ARENA for i in range(SHARDS)})
    threads = [
        threading.Thread(target=lambda s=s: [_commit(files, s, v) for v in range(1, 8 + s)]) for s in range(SHARDS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files.close()

    files, headers = _reopen(tmp_path)
    assert {s: h.version for s, h in headers.items()} == {s: 7 + s for s in range(SHARDS)}
    for s in range(SHARDS):
        assert _read(files, s) == bytes([16 * s + 7 + s]) * ARENA
    # Every slot not holding a committed version is free again.
    assert len(files.files["m"].free) == 2
    files.close()


def test_a_freed_slot_torn_while_reused_does_not_hide_the_newest_version(tmp_path):
    files = _files(tmp_path, spare_slots=1)
    files.create_model(spec_to_dict(_spec()), 0, {i: ARENA for i in range(SHARDS)})
    for s in range(SHARDS):
        _commit(files, s, 1)
    _commit(files, 0, 2)  # shard 0's version 1 slot is now free, its header still says (0, 1)
    stale = files.files["m"].free[0]
    layout = files.files["m"].layout
    files.close()
    # A crash while another shard's bytes were being written into that slot: data torn,
    # header not yet written.
    with open(tmp_path / "m.arena", "r+b") as f:
        f.seek(stale * layout.slot_bytes)
        assert SlotHeader.unpack(f.read(PAGE)).version == 1
        f.write(b"\xee" * ARENA)

    files, headers = _reopen(tmp_path)
    assert headers[0].version == 2
    assert _read(files, 0) == bytes([2]) * ARENA
    files.close()


def test_capacity_refuses_a_model_that_would_exceed_it(tmp_path):
    layout = FileLayout.for_shards({i: ARENA for i in range(SHARDS)}, spare_slots=1)
    files = _files(tmp_path, spare_slots=1, capacity=layout.size + layout.size // 2)
    files.create_model(spec_to_dict(_spec("a")), 0, {i: ARENA for i in range(SHARDS)})
    with pytest.raises(NoCapacity, match=f"it needs {layout.size} bytes on NVMe"):
        files.create_model(spec_to_dict(_spec("b")), 0, {i: ARENA for i in range(SHARDS)})
    assert not (tmp_path / "b.arena").exists()
    files.close()


@pytest.mark.parametrize("fails", ["arena", "record", "fsync"])
def test_a_registration_the_disk_has_no_room_for_leaves_no_file_behind(tmp_path, monkeypatch, fails):
    """ENOSPC while allocating the arena, writing the record or syncing it: the error comes
    back, and neither the arena, nor the record, nor its temporary file stays on the disk (they
    used to, taking its room); the model is not known, and the next registration works."""
    files = _files(tmp_path)
    full = OSError(errno.ENOSPC, "No space left on device")

    def raise_full(*args, **kwargs):
        raise full

    target = {"arena": "posix_fallocate", "record": "replace", "fsync": "fsync"}[fails]
    if target == "replace":
        monkeypatch.setattr(Path, "replace", raise_full)
    else:
        monkeypatch.setattr(f"ps_offload.daemon.tiers.nvme.os.{target}", raise_full)
    with pytest.raises(OSError) as info:
        files.create_model(spec_to_dict(_spec("full")), 0, {i: ARENA for i in range(SHARDS)})
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert "full" not in files.files
    files.create_model(spec_to_dict(_spec("next")), 0, {i: ARENA for i in range(SHARDS)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["next.arena", "next.json"]
    files.close()


@pytest.mark.parametrize("other", [1, FORMAT_VERSION + 1])  # fixed A/B slots; a later release's
def test_a_record_of_another_format_stops_recovery_with_its_path(tmp_path, other):
    files = _files(tmp_path)
    files.create_model(spec_to_dict(_spec()), 0, {i: ARENA for i in range(SHARDS)})
    files.close()
    record = tmp_path / "m.json"
    written = f'"format": {FORMAT_VERSION}'
    assert written in record.read_text()
    record.write_text(record.read_text().replace(written, f'"format": {other}'))
    with pytest.raises(OSError, match="m.json is not a model record this daemon can read"):
        _files(tmp_path).recorded_models()


def test_the_tiers_import_nothing_of_the_store():
    """The tiers sit below the store: they may know the model spec, never the store or a shard
    (anywhere in the file, function bodies included; they once imported each other)."""
    import ast
    from pathlib import Path

    above = ("store", "rpc", "dataplane", "server")  # folders since issue 24
    for path in sorted((Path(__file__).parents[3] / "ps_daemon" / "tiers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ps_offload.daemon."):
                assert node.module.removeprefix("ps_offload.daemon.").split(".")[0] not in above, (
                    f"{path.name} imports {node.module}"
                )
