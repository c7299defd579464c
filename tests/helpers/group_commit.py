"""One model's NVMe files written the way a daemon writes them, from a test or from a child
process a test kills mid-commit (tests/ps_daemon/tiers/test_commit_group.py): every shard
commits arenas of one byte value per (shard, version), so what recovery finds says which
version it is."""

from __future__ import annotations

from pathlib import Path

from ps_offload.daemon.model.spec import ModelSpec, ParamSpec, spec_from_dict, spec_to_dict
from ps_offload.daemon.tiers.direct_io import DirectIO
from ps_offload.daemon.tiers.nvme import PAGE, NvmeFiles, aligned_empty
from ps_offload.optimizers import SGD

SHARDS = 6
ARENA = 3 * PAGE


def files_on(directory: Path) -> NvmeFiles:
    return NvmeFiles(directory, io=DirectIO(threads=2, block_bytes=PAGE), fsync=True, spare_slots=SHARDS)


def create_files(directory: Path) -> NvmeFiles:
    files = files_on(directory)
    spec = ModelSpec("m", (ParamSpec("w", (SHARDS * 1024,)),), SGD(lr=0.1), 4096, ("d",))
    files.create_model(spec_to_dict(spec), 0, {i: ARENA for i in range(SHARDS)})
    return files


def fill(shard: int, version: int) -> int:
    return 16 * shard + version


def commit(files: NvmeFiles, shard: int, version: int) -> None:
    _, view = aligned_empty(ARENA)
    view[:] = bytes([fill(shard, version)]) * ARENA
    files.commit("m", shard, view, version=version, initialized=True, numel=1024)


def recovered(directory: Path) -> dict[int, int]:
    """Each shard's recovered version, its bytes checked to be that version's."""
    files = files_on(directory)
    (spec, _, layout) = files.recorded_models(parse=spec_from_dict)[0]
    headers, rolled_back = files.open_model(spec, layout, set(range(SHARDS)))
    assert rolled_back == {}
    versions = {}
    for shard, header in headers.items():
        _, out = aligned_empty(ARENA)
        files.load("m", shard, out)  # raises CorruptShard on a torn arena
        assert bytes(out) == bytes([fill(shard, header.version)]) * ARENA
        versions[shard] = header.version
    files.close()
    return versions
