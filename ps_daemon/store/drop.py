"""Dropping a model (ps-admin drop, Admin.DropModel): its shards leave RAM and its files leave
nvme_dir, and calls in flight for it end cleanly.

Order, and why. (1) The store takes the model out of its table and keeps its name reserved,
so no new call finds it and no registration of the same name creates files while the old ones
are still open. (2) Each shard is marked dropped and its waiters woken: a pull waiting for a
version, a reader or writer waiting for its hold, and a load about to start all end with
NOT_FOUND; holds already taken are waited for (at most `timeout`), because a commit or a master
read still running uses the model's file descriptor, and closing it under them could let the
descriptor number be reused by another file. If they do not end in time, the drop is undone
and nothing is lost. (3) The RAM tier forgets the shards (loads in progress finish first) and
frees their arenas; gradient sums are released. (4) The file is closed and deleted with its
record, its versions record and its snapshots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ps_offload.daemon.store.shard import Shard


@dataclass(frozen=True)
class Dropped:
    shards: int  # shards this daemon held for the model
    disk_bytes: int  # of files deleted from nvme_dir
    ram_bytes: int  # of arenas and gradient sums released
    was_damaged: bool


def stop_using(shards: list[Shard], timeout: float) -> bool:
    """Marks the shards dropped, wakes everything waiting on them, and waits for the holds
    already taken to end. False (and nothing marked) if one is still held after `timeout`."""
    for shard in shards:
        with shard.cond:
            shard.dropped = True
            shard.notify_locked()
    deadline = time.monotonic() + timeout
    for shard in shards:
        with shard.cond:
            idle = shard.cond.wait_for(
                lambda s=shard: not s.writing and s.readers == 0, max(deadline - time.monotonic(), 0)
            )
        if not idle:
            for undone in shards:
                with undone.cond:
                    undone.dropped = False
                    undone.cond.notify_all()
            return False
    return True


def release_sums(shards: list[Shard]) -> int:
    """Frees the gradient sums of steps pushed in parts (and their steps computed ahead);
    returns the sums' bytes."""
    freed = 0
    for shard in shards:
        with shard.parts.lock:
            freed += shard.parts.release_locked()
    return freed
