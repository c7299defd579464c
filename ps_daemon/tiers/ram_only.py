"""The tiers of a daemon without store.nvme_dir: every shard is in RAM from its registration
to its drop, nothing is kept at rest, and a restart loses everything (the trainer pushes the
model's values again). Each class fills a role of ps_offload.daemon.tiers.tier with what
that means, so the store never asks whether there is a disk, except where the behaviour
itself differs (`NoShardFiles.at_rest`).
"""

from __future__ import annotations

import contextlib
from types import MappingProxyType

from ps_offload.daemon.errors import FailedPrecondition
from ps_offload.daemon.tiers.tier import TierStats


class RamOnlyTier:
    """A ResidencyTier with no budget to manage: a shard is resident from birth
    (ps_offload.daemon.store.shard.Shard), so there is nothing to load, evict or prefetch."""

    def use(self, shard, *, pull: bool = False) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def use_if_resident(self, shard) -> contextlib.AbstractContextManager[bool]:
        return contextlib.nullcontext(True)

    def evict(self, shard) -> bool:
        raise FailedPrecondition("this daemon has no NVMe tier (store.nvme_dir); shards cannot leave RAM")

    def forget(self, shards: list, timeout: float) -> int:
        freed = sum(shard.resident_bytes for shard in shards)
        for shard in shards:
            shard.detach()
        return freed

    def prefetch(self, shards: list, *, limit: int | None = None, after_upcoming: bool = False) -> int:
        return 0

    def resident_bytes(self, shards: list) -> int:
        return sum(shard.resident_bytes for shard in shards)

    def counters(self) -> TierStats:
        return TierStats()

    def close(self) -> None:
        pass


class NoShardFiles:
    """ShardFiles that keep nothing: a commit is done once the values are in RAM, no model is
    recorded (recovery finds none), no shard has a committed slot, and every counter is 0."""

    at_rest = False
    files = MappingProxyType({})
    bytes_allocated = capacity = bytes_read = bytes_written = master_reads = master_bytes_read = 0
    commits = commit_groups = flushes = 0
    read_seconds = write_seconds = flush_seconds = 0.0

    def create_model(self, spec: dict, daemon_index: int, arena_bytes: dict[int, int]) -> None:
        return None

    def recorded_models(self, damaged: dict[str, str] | None = None, *, parse=dict) -> list:
        return []

    def commit(
        self, model: str, shard_id: int, arena: memoryview | None, *, version: int, initialized: bool, numel: int
    ) -> None:
        pass

    def committed_slot(self, model: str, shard_id: int) -> None:
        return None

    def delete_model(self, model: str) -> int:
        return 0

    def restart_problem(self, model: str) -> str:
        return ""

    def close(self) -> None:
        pass
