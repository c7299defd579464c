"""A pull of a shard's master values on a daemon with an NVMe tier: from RAM when the shard is
resident, else read from its committed slot on disk, the master region only, without making
the shard resident.

Why. A trainer that streams a model larger than itself (trainer/stream/optimizer.py) pulls each
block twice a step, before its forward and before its backward, and pushes its gradient once.
Loading the whole arena for each pull (master, m and v: 12 bytes per parameter with AdamW)
would read the state from disk up to three times a step and evict shards the tier holds for
updates; what a pull sends is the master values, 4 of those 12 bytes. (ZeRO-Infinity keeps
parameters apart from optimizer state for the same reason.)

Resident or not is decided under the shard's read hold, after the wait for `min_version` (so a
pull that waits for a push finds the shard that push loaded), by RamTier.use_if_resident:
resident, or being loaded (waited for), it is served from RAM as every pull was, pinned; on
NVMe only, it is read from disk. That read takes no room in the tier, evicts nothing, is not a
tier hit or miss, and is counted in Stats as `nvme_master_reads` and `nvme_master_bytes_read`
(and in `nvme_bytes_read`, with the loads).

Consistency. The read hold lasts the disk read: the shard's next commit, the only thing that
frees its committed slot for reuse, waits for it, so the bytes read are the version the pull
reports. The hold ends once they are in the scratch buffer (this pull's own copy, as a rounded
pull's is), so an update need not wait for the send.

Integrity. A slot in format 3 (ps_offload.daemon.tiers.slot_header) carries a crc32c of its master
region; a mismatch is DATA_LOSS naming the shard, which is refused from then on, as after a
failed load. A slot in format 2, written by the release before, has none: the pull loads the
shard whole as before (the whole arena's checksum verifies it), and the shard's first update
rewrites it in format 3.

Scratch. O_DIRECT reads whole pages into page-aligned memory: a buffer from the pull's
`scratch` (the StagingPool that pushes and narrow pulls borrow from), one page longer than the
region and used from its first page boundary; without `scratch`, a fresh mapping. A bf16/fp16
pull rounds from it into a second borrowed buffer and gives the first back at once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from ps_offload.daemon.store.persistence import read_master
from ps_offload.daemon.store.pull import PullRequest
from ps_offload.daemon.store.pull_rounding import rounded
from ps_offload.daemon.store.shard import Shard
from ps_offload.daemon.tiers.tier import PAGE, ResidencyTier, ShardFiles, aligned_empty

log = logging.getLogger(__name__)

Scratch = Callable[[int], contextlib.AbstractContextManager[torch.Tensor]]


def pull_master(
    sending: contextlib.ExitStack,
    files: ShardFiles,
    tier: ResidencyTier,
    shard: Shard,
    pull: PullRequest,
    *,
    timeout: float,
    scratch: Scratch | None,
) -> tuple[torch.Tensor, int] | None:
    """The shard's master values in `pull.dtype` and the version they are, once it is at
    `pull.min_version` or later; what must last while they are sent (a read hold and pin, or a
    buffer) is entered on `sending`. None, with nothing held, when the committed slot has no
    master checksum (format 2): the caller loads the shard whole instead."""
    dtype = pull.dtype
    with contextlib.ExitStack() as copy:  # the disk read's buffer, if one is read
        with contextlib.ExitStack() as held:
            version = held.enter_context(shard.reading(pull.min_version, timeout))
            if held.enter_context(tier.use_if_resident(shard)):
                if dtype == shard.state_dtype:
                    sending.enter_context(held.pop_all())  # pinned and held while it is sent
                    return shard.master, version
                return sending.enter_context(rounded(shard.master, dtype, scratch)), version
            found = files.committed_slot(shard.model, shard.slice.shard_id)
            if found is None or found[1].master_crc is None:
                return None
            slot, header = found
            if header.version != version:  # never expected: the hold keeps the two together
                log.warning(
                    "shard %d of model %r is at version %d, its committed slot %d at %d; loading it whole",
                    shard.slice.shard_id, shard.model, version, slot, header.version,
                )  # fmt: skip
                return None
            region, region_bytes = copy.enter_context(_page_aligned(header.master_bytes, scratch))
            read_master(files, shard, slot, header, region_bytes)
        # The hold has ended: the region is this pull's copy of `version`.
        values = region.view(shard.master_dtype)[: shard.slice.numel]
        if dtype == shard.state_dtype:
            sending.enter_context(copy.pop_all())
            return values, version
        return sending.enter_context(rounded(values, dtype, scratch)), version


@contextlib.contextmanager
def _page_aligned(nbytes: int, scratch: Scratch | None) -> Iterator[tuple[torch.Tensor, memoryview]]:
    """`nbytes` (whole pages) of page-aligned memory, as an fp32 tensor and as the byte view
    O_DIRECT reads into, for the block's duration."""
    if scratch is None:
        region, view = aligned_empty(nbytes)
        yield torch.frombuffer(region, dtype=torch.float32), view
        return
    with scratch((nbytes + PAGE) // 4) as buffer:
        skip = -buffer.data_ptr() % PAGE // 4  # fp32 elements to the first page boundary
        values = buffer[skip : skip + nbytes // 4]
        yield values, memoryview(values.numpy()).cast("B")
