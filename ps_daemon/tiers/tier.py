"""What the store asks of its tiers, whether or not the daemon has an NVMe directory.

Three roles, each filled by one object the composition root picks when the store is made
(ps_offload.daemon.composition.build_tiers):

                     with store.nvme_dir                         RAM only
    ResidencyTier    RamTier (tiers.ram): a byte budget of       RamOnlyTier (tiers.ram_only): every
                     resident shards over NVMe                   shard resident from birth to drop
    ShardFiles       NvmeFiles (tiers.nvme): committed slots     NoShardFiles: nothing kept, nothing
                     that survive a restart                      recovered
    SumStore         AccumulatorFiles (tiers.accumulator_files)  RamSums (here): anonymous memory

so the store's code is the same for both kinds of daemon. Where the two genuinely behave
differently (verify reads slots back or checks memory; snapshots need slots to pin; a failed
update rolls back to the committed copy or is refused), the code asks `ShardFiles.at_rest`.

The tiers hold shards without knowing what one is (they import neither the store nor the
model): `shard` below is ps_offload.daemon.store.shard.Shard, duck-typed.

This module is all the store sees of the tiers (tests/test_layering.py holds it to that): the
roles, the `Tiers` the composition root builds (ps_offload.daemon.composition), the errors the
tiers raise, and the page-aligned memory O_DIRECT reads and writes, which the store allocates.
"""

from __future__ import annotations

import contextlib
import mmap
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

PAGE = 4096
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")


class NoCapacity(Exception):
    """A model's arena file would take the daemon past `store.nvme_bytes`."""


class CorruptShard(Exception):
    """A shard's newest committed bytes on disk do not match their checksum."""


class NoFreeSlot(Exception):
    """Every slot of a model file is taken for longer than a commit should last."""


class SnapshotRefused(Exception):
    """The snapshot cannot be taken (a shard is past its step, the name is taken, ...)."""


@dataclass(frozen=True)
class SlotCheck:
    """What reading a committed slot back found (ShardFiles.check_slot)."""

    version: int
    slot: int
    bytes_read: int
    problem: str  # "" when the header and the bytes match; else why not


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


HUGE_PAGE = 2 << 20


def aligned_empty(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Page-aligned, zero-filled memory that O_DIRECT can read and write, `nbytes` rounded up
    to whole pages.

    Private, not shared: `mmap.mmap(-1, n)` alone maps shared anonymous memory (shmem), and
    O_DIRECT from shmem pages moved 0.79x the bytes per second DeepSpeed's aio did from its
    private buffers, where the same engine from private memory moved 1.09x (bench/nvme_io.py,
    docs/benchmarks.md). Buffers of a huge page or more ask for transparent huge pages
    (MADV_HUGEPAGE: the kernel's `madvise` mode, its default, gives them only when asked):
    fewer pages to pin per request and fewer TLB misses for the optimizer's passes."""
    size = round_up(max(nbytes, 1))
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages: 4 KiB pages, as before
            pass
    return region, memoryview(region)


def arena_tensor(numel: int, nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A zeroed fp32 tensor of `numel` elements over page-aligned memory whose whole-page
    extent (`nbytes` rounded up) is returned as the view O_DIRECT reads and writes."""
    region, view = aligned_empty(nbytes)
    tensor = torch.frombuffer(region, dtype=torch.float32, count=numel)
    return tensor, view


@dataclass
class TierStats:
    """The residency tier's counters (ps-admin stats)."""

    hits: int = 0
    misses: int = 0
    prefetched: int = 0
    evictions: int = 0


class ResidencyTier(Protocol):
    """Which shards are in RAM."""

    def use(self, shard: Any, *, pull: bool = False) -> contextlib.AbstractContextManager[None]:
        """Pins the shard resident for the block, loading it first if it is not. Raises
        TierFull (a ResourceExhausted) when no room is made in time. `pull`: a read, after
        which the shard's push is still to come."""
        ...

    def use_if_resident(self, shard: Any) -> contextlib.AbstractContextManager[bool]:
        """Pins the shard for the block and yields True if it is resident (or once its load in
        flight ends); yields False, having pinned nothing, if it is at rest only."""
        ...

    def evict(self, shard: Any) -> bool:
        """Drops the shard from RAM (ps-admin evict); False while it is pinned."""
        ...

    def forget(self, shards: list, timeout: float) -> int:
        """Frees a dropped model's arenas; returns their bytes (TimeoutError if a load of
        one outlasts `timeout`)."""
        ...

    def prefetch(self, shards: list, *, limit: int | None = None, after_upcoming: bool = False) -> int:
        """Queues loads of the shards not resident, in this order; returns how many.
        `after_upcoming`: the order follows the shards already upcoming (a trainer's hint)
        instead of replacing them."""
        ...

    def resident_bytes(self, shards: list) -> int:
        """RAM the tier holds for `shards` (all of the store's)."""
        ...

    def counters(self) -> TierStats: ...

    def close(self) -> None: ...


class ShardFiles(Protocol):
    """Where committed versions are kept at rest. The operations on a recorded model's file
    (open_model, forget, arena_path, load, read_slot, read_master, check_slot, check_buffer and the
    snapshot pins of `files[model]`) are NvmeFiles' own: the store reaches them only for a
    model `recorded_models` gave, a slot `committed_slot` found, or where `at_rest` is true."""

    # True: every committed version is on disk and survives a restart; shards may leave RAM.
    at_rest: bool
    files: Mapping[str, Any]  # per model: its open file (tiers.model_file.ModelFile)
    # Counters (ps-admin stats).
    bytes_allocated: int
    capacity: int
    bytes_read: int
    bytes_written: int
    read_seconds: float
    write_seconds: float
    master_reads: int
    master_bytes_read: int
    commits: int  # group commit: versions made durable, their groups, fdatasyncs and their time
    commit_groups: int
    flushes: int
    flush_seconds: float

    def create_model(self, spec: dict, daemon_index: int, arena_bytes: dict[int, int]) -> object: ...

    def recorded_models(
        self, damaged: dict[str, str] | None = None, *, parse: Callable[[dict], object] = dict
    ) -> Iterable[tuple[object, int, object]]:
        """(spec, daemon_index, layout) of every model recorded at rest."""
        ...

    def commit(
        self, model: str, shard_id: int, arena: memoryview, *, version: int, initialized: bool, numel: int
    ) -> None:
        """Persists a shard's new version before its push is acknowledged."""
        ...

    def committed_slot(self, model: str, shard_id: int) -> tuple[int, Any] | None:
        """(slot, header) of the shard's newest committed version; None if it has none."""
        ...

    def delete_model(self, model: str) -> int:
        """Deletes a model's files; returns their bytes."""
        ...

    def restart_problem(self, model: str) -> str:
        """Why an open model would not come back at the next start ("" when it would)."""
        ...

    def close(self) -> None: ...


class SumStore(Protocol):
    """Where the sums of steps pushed in parts are made (ps_offload.daemon.store.accumulate)."""

    # True: in anonymous memory, counted as the store's RAM (nothing can page it out).
    in_ram: bool

    def allocate(self, numel: int) -> torch.Tensor:
        """An fp32 tensor of `numel` values (contents unset)."""
        ...


class RamSums:
    """A SumStore in anonymous memory: the sums count as the store's RAM."""

    in_ram = True

    def allocate(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32)


RAM_SUMS = RamSums()  # stateless: one for every shard that has no other


@dataclass(frozen=True)
class Tiers:
    """The three roles filled for one store, chosen once by the composition root."""

    files: ShardFiles
    residency: ResidencyTier
    sums: SumStore
