"""The 4 KiB header at the start of every slot of a model's arena file (ps_offload.daemon.tiers.nvme):
which shard and version the slot's bytes are, and their checksums.

Formats, by the number each header carries after its magic:

* 3 (written by this release): the crc32c of the whole arena (`data_crc`) and, on its own, of
  its master region: the first `master_bytes` of the arena, the shard's fp32 master values
  rounded up to whole pages (ps_offload.daemon.store.shard puts them first). A pull of the master values of
  a shard that is not in RAM reads and checks that region alone (ps_offload.daemon.store.master_pull).
* 2: the same without the master fields. Still read: recovery, loads and verify check the whole
  arena as before, and a master-only pull of such a slot loads the shard whole instead. Every
  commit writes format 3, so a shard leaves format 2 at its first update after an upgrade.
* 1 (fixed A/B slots per shard): refused, with its model's record (nvme.spec_from_json).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c

from ps_offload.daemon.tiers.tier import round_up

_MAGIC = b"PSOFSHD1"
FORMAT_VERSION = 3
READABLE_FORMATS = (2, 3)
_PREFIX = struct.Struct("<8sI")  # magic, format: which body follows
# magic, format, shard_id, version, initialized, numel, arena_bytes, data_crc; then the header's crc
_BODY_V2 = struct.Struct("<8sIIQB3xQQI")
# format 2's fields, then master_bytes, master_crc
_BODY_V3 = struct.Struct("<8sIIQB3xQQIQI")
_BODIES = {2: _BODY_V2, 3: _BODY_V3}
_HEADER_CRC = struct.Struct("<I")


def master_region_bytes(numel: int, arena_bytes: int) -> int:
    """The bytes a master-only read takes from the start of a slot's arena: the shard's `numel`
    fp32 master values rounded up to whole pages (O_DIRECT reads whole pages; the tail holds the
    stagger and, for a shard of an odd size, the first optimizer state values), at most the arena."""
    return min(round_up(numel * 4), arena_bytes)


@dataclass(frozen=True)
class SlotHeader:
    shard_id: int
    version: int
    initialized: bool
    numel: int
    arena_bytes: int
    data_crc: int  # crc32c of all arena_bytes
    master_bytes: int = 0  # the master region (master_region_bytes); 0 in format 2
    master_crc: int | None = None  # crc32c of the master region; None: format 2, which has none

    @property
    def format(self) -> int:
        return 2 if self.master_crc is None else 3

    def pack(self) -> bytes:
        """The header block's bytes, in the header's own format (2 only for one read from such
        a slot: every commit builds a format 3 header)."""
        fields = [_MAGIC, self.format, self.shard_id, self.version, self.initialized, self.numel, self.arena_bytes]
        fields.append(self.data_crc)
        if self.master_crc is not None:
            fields += [self.master_bytes, self.master_crc]
        body = _BODIES[self.format].pack(*fields)
        return body + _HEADER_CRC.pack(crc32c.crc32c(body))

    @classmethod
    def unpack(cls, block: bytes | memoryview) -> SlotHeader | None:
        """None for a block that is not a valid header of a format this daemon reads (never
        written, torn, or format 1)."""
        magic, fmt = _PREFIX.unpack_from(block)
        body_format = _BODIES.get(fmt)
        if magic != _MAGIC or body_format is None:
            return None
        body = bytes(block[: body_format.size])
        (crc,) = _HEADER_CRC.unpack_from(block, body_format.size)
        if crc32c.crc32c(body) != crc:
            return None
        _, _, shard_id, version, initialized, numel, arena_bytes, data_crc, *master = body_format.unpack(body)
        master_bytes, master_crc = master or (0, None)
        return cls(shard_id, version, bool(initialized), numel, arena_bytes, data_crc, master_bytes, master_crc)


def checksums(arena: memoryview, numel: int) -> tuple[int, int, int]:
    """(master_bytes, master_crc, data_crc) of an arena about to be committed, in one pass:
    the whole arena's crc32c continues from its master region's."""
    master_bytes = master_region_bytes(numel, len(arena))
    master_crc = crc32c.crc32c(arena[:master_bytes])
    return master_bytes, master_crc, crc32c.crc32c(arena[master_bytes:], master_crc)
