"""A shard's committed copy on NVMe, as the store uses it: a model's files created at
registration, a shard loaded at its last committed version (or only its master values read,
ps_offload.daemon.store.master_pull), a new version committed before its push is acknowledged, and a
failed update rolled back. The NVMe tier's own errors
(ps_offload.daemon.tiers.nvme) come out as the typed errors of ps_offload.daemon.errors, each saying what
state the shard was left in.

On a RAM-only daemon `files` is ps_offload.daemon.tiers.ram_only.NoShardFiles: a commit keeps
nothing, and a failed update has no copy to return to. The store decides when these run
(ps_offload.daemon.store.shard_store); the commit protocol itself is ps_offload.daemon.tiers.nvme's.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

import torch

from ps_offload.daemon.errors import DataLoss, ResourceExhausted, StorageError
from ps_offload.daemon.model.spec import ModelSpec, spec_to_dict
from ps_offload.daemon.store.shard import Shard
from ps_offload.daemon.tiers.tier import CorruptShard, NoCapacity, NoFreeSlot, ShardFiles

# The store's name: these lines were logged by ps_offload.daemon.store.shard_store before it was split, and
# journald filters or alerts written against that name keep matching.
log = logging.getLogger("ps_offload.daemon.store.shard_store")


def create_files(files: ShardFiles, spec: ModelSpec, daemon_index: int, shards: dict[int, Shard]) -> None:
    """Creates the files of a newly registered model, room for `shards` (the ones this
    daemon owns). Raises ResourceExhausted when the disk or the configured size is too small."""
    arena_bytes = {sid: shard.arena_bytes for sid, shard in shards.items()}
    where = f"model {spec.model!r} on this daemon"
    try:
        files.create_model(spec_to_dict(spec), daemon_index, arena_bytes)
    except NoCapacity as exc:
        raise ResourceExhausted(f"{where}: {exc}. Raise store.nvme_bytes or add daemons") from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            layout = files.layout_for(arena_bytes)
            raise ResourceExhausted(
                f"{where}: nvme_dir {files.dir} has no room for its {layout.size} bytes "
                f"({layout.slots} slots of {layout.slot_bytes}); free space or add daemons"
            ) from exc
        raise StorageError(f"{where}: cannot create its files: {exc}") from exc


def load_into(files: ShardFiles, shard: Shard, buffer: tuple[torch.Tensor, memoryview]) -> None:
    """The RAM tier's loader: attaches `buffer` and reads the committed version into it."""
    shard.attach(buffer)
    try:
        load_committed(files, shard)
    except BaseException:
        shard.detach()
        raise


def load_committed(files: ShardFiles, shard: Shard) -> None:
    """Sets the shard to its last committed version on disk (zeros if none). Raises
    DataLoss, and marks the shard, when those bytes fail their checksum."""
    try:
        header = files.load(shard.model, shard.slice.shard_id, shard.io_view)
    except CorruptShard as exc:
        raise _corrupt(shard, exc) from exc
    if header is None:
        shard.arena.zero_()
        shard.set_version(0, initialized=False)
    else:
        shard.set_version(header.version, initialized=header.initialized)


def read_master(files: ShardFiles, shard: Shard, slot: int, header: Any, buffer: memoryview) -> None:
    """Reads the master region of the shard's committed `slot` into `buffer`
    (NvmeFiles.read_master; the caller holds the shard for reading). Raises DataLoss, and
    marks the shard, when the region fails its checksum (the whole arena would fail too) or
    the header names another size."""
    try:
        if header.numel != shard.slice.numel:
            raise CorruptShard(f"header of slot {slot} says {header.numel} values, the shard has {shard.slice.numel}")
        files.read_master(shard.model, slot, header, buffer)
    except CorruptShard as exc:
        raise _corrupt(shard, exc) from exc


def _corrupt(shard: Shard, exc: CorruptShard) -> DataLoss:
    """Marks the shard corrupt at rest, refused from now on (ModelRegistry.shard), and returns
    the error that says so."""
    shard.corrupt = (
        f"shard {shard.slice.shard_id} of model {shard.model!r} is corrupt on disk ({exc}); "
        "restore it from a checkpoint or re-register the model"
    )
    log.error("%s", shard.corrupt)
    return DataLoss(shard.corrupt)


def commit(files: ShardFiles, shard: Shard) -> None:
    """Persists the shard's new version before it is acknowledged. On a write error the
    shard goes back to its last committed version and the push fails."""
    try:
        files.commit(
            shard.model,
            shard.slice.shard_id,
            shard.io_view,
            version=shard.version,
            initialized=shard.initialized,
            numel=shard.slice.numel,
        )
    except NoFreeSlot as exc:
        load_committed(files, shard)
        raise StorageError(
            f"shard {shard.slice.shard_id} of model {shard.model!r}: {exc} (failed writes take slots "
            f"out of use until restart); the update was not applied, the shard keeps version {shard.version}"
        ) from exc
    except OSError as exc:
        load_committed(files, shard)  # back to the last committed version
        where = f"shard {shard.slice.shard_id} of model {shard.model!r}"
        if exc.errno == errno.ENOSPC:
            raise ResourceExhausted(
                f"{where}: nvme_dir is full; the update was not applied and the shard keeps "
                f"version {shard.version}. Free space, then retry the push"
            ) from exc
        raise StorageError(
            f"{where}: writing the update failed ({exc}); it was not applied and the shard "
            f"keeps version {shard.version}"
        ) from exc


def roll_back(files: ShardFiles, shard: Shard) -> None:
    """A shard whose optimizer step failed midway must not keep half a step under its old
    version (later steps would apply on top): back to the last committed version with NVMe;
    RAM only there is no copy, so the shard is refused (DATA_LOSS) from now on."""
    if files.at_rest:
        load_committed(files, shard)
    else:
        shard.optimizer.step.fill_(shard.version)
        shard.corrupt = (
            f"shard {shard.slice.shard_id} of model {shard.model!r}: an update failed midway and its "
            "values cannot be trusted; restart the daemon and push the model's values again"
        )
        log.error("%s", shard.corrupt)
