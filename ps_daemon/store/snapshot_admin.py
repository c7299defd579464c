"""A model's snapshots on this daemon (Admin.CreateSnapshot, ListSnapshots, DeleteSnapshot, each
given the store's files; pulls with PullRequest.snapshot, through ShardStore.pull_snapshot): the
pinning itself is ps_offload.daemon.tiers.snapshot_pins', which says how a snapshot is kept
without a copy. A RAM-only daemon has no committed slots to pin (ShardFiles.at_rest false)."""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ps_offload.daemon.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from ps_offload.daemon.model.optimizer import state_tensors
from ps_offload.daemon.store.shard import SHARD_TENSORS, Shard, arena_offsets
from ps_offload.daemon.tiers.tier import (
    SNAPSHOT_NAME,
    CorruptShard,
    NoCapacity,
    ShardFiles,
    SnapshotRefused,
    arena_tensor,
)


@dataclass(frozen=True)
class SnapshotInfo:
    name: str
    step: int
    created: float
    shards: int  # this daemon's shards in it
    pinned: int  # of those, pinned so far (all, once complete)
    bytes: int  # disk the pinned slots hold
    complete: bool
    damaged: str


def _info(files: ShardFiles, model: str, snap: Any) -> SnapshotInfo:
    slot_bytes = files.files[model].layout.slot_bytes
    shards = len(snap.pinned) + len(snap.waiting)
    pinned = len(snap.pinned)
    return SnapshotInfo(
        snap.name, snap.step, snap.created, shards, pinned, pinned * slot_bytes, snap.complete, snap.damaged
    )


def _files(files: ShardFiles) -> ShardFiles:
    if not files.at_rest:
        raise FailedPrecondition(
            "this daemon has no NVMe tier (store.nvme_dir): snapshots pin committed slots on disk; "
            "use ps-admin export for a copy of the parameters"
        )
    return files


def take(
    files: ShardFiles,
    model: str,
    name: str,
    step: int,
    shard_ids: set[int],
    timeout: float,
    caller_left: threading.Event | None = None,
):
    """Snapshots this daemon's shards of `model` at `step` (ps_offload.daemon.tiers.snapshot_pins), waiting
    up to `timeout` for the shards behind it to commit that version; cancelled if they do not,
    or when `caller_left` is set (then wake() the model's waiters)."""
    files = _files(files)
    if not SNAPSHOT_NAME.match(name):
        raise InvalidArgument(
            f"snapshot name {name!r} is not allowed: 1 to 100 of A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    file = files.files[model]
    with file.cond:  # refused early, before the file grows (checked again when pinning)
        try:
            file.snapshots.check_locked(name, step, file.active, shard_ids)
        except SnapshotRefused as exc:
            raise FailedPrecondition(f"snapshot {name!r} of model {model!r}: {exc}") from exc
    try:
        files.grow(model, len(shard_ids))  # room for the commits while these slots are pinned
    except NoCapacity as exc:
        raise ResourceExhausted(f"snapshot {name!r} of model {model!r}: {exc}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ResourceExhausted(f"snapshot {name!r} of model {model!r}: nvme_dir is full ({exc})") from exc
        raise
    with file.cond:
        try:
            snap = file.snapshots.begin_locked(name, step, file.active, shard_ids)
        except SnapshotRefused as exc:
            raise FailedPrecondition(f"snapshot {name!r} of model {model!r}: {exc}") from exc
        left = caller_left or threading.Event()
        done = file.cond.wait_for(
            lambda: snap.complete or name not in file.snapshots.snapshots or left.is_set() or file.dropped, timeout
        )
        if file.dropped:
            raise NotFound(
                f"model {model!r} was dropped while snapshot {name!r} waited for step {step}; nothing was kept"
            )
        if not done or not snap.complete and left.is_set():
            behind = sorted(snap.waiting)
            file.release(file.snapshots.remove_locked(name))
            raise DeadlineExceeded(
                f"snapshot {name!r} of model {model!r}: {len(behind)} shards (first: {behind[0]}) did not reach "
                f"step {step} in {timeout:.0f}s; it was cancelled. Take it while the trainers run, or at the "
                "step they stopped at"
            )
        if name not in file.snapshots.snapshots:
            raise FailedPrecondition(f"snapshot {name!r} of model {model!r} was deleted while it was being taken")
    _write_record(file)
    return _info(files, model, snap)


def wake(files: ShardFiles, model: str) -> None:
    """Wakes the snapshots waiting on the model, to see whether their caller left."""
    file = files.files.get(model)  # None without NVMe: nothing waits
    if file is not None:
        with file.cond:
            file.cond.notify_all()


def listed(files: ShardFiles, model: str) -> list[SnapshotInfo]:
    if not files.at_rest:  # snapshots pin committed slots: none without NVMe
        return []
    file = files.files[model]
    with file.cond:
        return [_info(files, model, snap) for _, snap in sorted(file.snapshots.snapshots.items())]


def delete(files: ShardFiles, model: str, name: str) -> SnapshotInfo:
    """Forgets a snapshot; its slots go back to the file's free list."""
    files = _files(files)
    file = files.files[model]
    with file.cond:
        snap = _named(file.snapshots.snapshots, model, name)
        info = _info(files, model, snap)
        file.release(file.snapshots.remove_locked(name))
    _write_record(file)
    return info


def _write_record(file) -> None:
    """Records the file's complete snapshots as they are now: each write takes the state
    under the save lock, so the last write is never an older state than an earlier one's."""
    with file.snapshots.save_lock:
        with file.cond:
            recorded = file.snapshots.record_locked()
        file.snapshots.write(recorded)


def _named(snapshots: dict[str, Any], model: str, name: str) -> Any:
    snap = snapshots.get(name)
    if snap is None:
        known = ", ".join(sorted(snapshots)) or "none"
        raise NotFound(f"model {model!r} has no snapshot {name!r} on this daemon (snapshots: {known})")
    return snap


def read_tensor(files: ShardFiles, shard: Shard, name: str, tensor: str) -> tuple[torch.Tensor, int]:
    """`tensor` (one of SHARD_TENSORS) of the shard as snapshot `name` holds it, read from its
    pinned slot and checked against the slot's crc32c; and the snapshot's step."""
    files, model = _files(files), shard.model
    file = files.files[model]
    with file.cond:
        snap = _named(file.snapshots.snapshots, model, name)
        if not snap.complete:
            raise FailedPrecondition(f"snapshot {name!r} of model {model!r} is still being taken")
        if snap.damaged:
            raise DataLoss(f"snapshot {name!r} of model {model!r} is damaged: {snap.damaged}")
        slot, header = snap.pinned[shard.slice.shard_id]
    numel, states = shard.slice.numel, state_tensors(shard.optimizer.config)
    index = SHARD_TENSORS.index(tensor)
    if index > states:
        raise FailedPrecondition(f"model {model!r} runs {shard.optimizer.plugin.name}, which has no {tensor}")
    if index and not shard.optimizer.plugin.per_element_state:
        shard.check_tensor(tensor)  # (refuses, saying why: factored state)
    words, view = arena_tensor(header.arena_bytes // 4, header.arena_bytes)
    values = words.view(shard.master_dtype)
    try:
        files.read_slot(model, slot, header, view)
    except CorruptShard as exc:
        raise DataLoss(
            f"snapshot {name!r} of model {model!r}: shard {shard.slice.shard_id}'s bytes in slot {slot} fail their "
            f"checksum ({exc})"
        ) from None
    start = arena_offsets(numel, shard.optimizer.state_numels())[index]
    return values[start : start + numel].float(), snap.step  # (snapshots travel in FLOAT32; widened from bf16 state)
