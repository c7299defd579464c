"""A daemon's NVMe files read and damaged from outside, as an operator's disk would damage
them: the slot holding a shard's committed version, a byte flipped in place, and the files
rewritten as the release before master checksums wrote them (format 2)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import crc32c

from ps_offload.daemon.tiers.nvme import PAGE, SlotHeader


def committed_slot(nvme: Path, shard_id: int) -> int:
    """The file offset of the slot holding the shard's newest valid header (its committed
    version), read from the arena file the way recovery reads it."""
    layout = json.loads(next(nvme.glob("*.json")).read_text())["layout"]
    newest: tuple[int, int] | None = None
    with open(next(nvme.glob("*.arena")), "rb") as f:
        for slot in range(layout["slots"]):
            f.seek(slot * layout["slot_bytes"])
            header = SlotHeader.unpack(f.read(PAGE))
            if header is not None and header.shard_id == shard_id and (newest is None or header.version > newest[1]):
                newest = (slot * layout["slot_bytes"], header.version)
    assert newest is not None, f"no committed slot for shard {shard_id}"
    return newest[0]


def flip_byte(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


# -- format 2 ------------------------------------------------------------------------------
# Files as the release before master checksums wrote them, made from files of this release:
# every valid slot header rewritten in format 2's layout, spelled out here rather than taken
# from the code under test, and each record marked format 2. The bytes and the layout are the
# same in both formats.

# magic, format, shard_id, version, initialized, numel, arena_bytes, data_crc; then the crc32c
# of those 48 bytes.
_FORMAT_2 = struct.Struct("<8sIIQB3xQQI")


def format_2_header(header: SlotHeader) -> bytes:
    """A whole header block, as format 2 wrote it."""
    body = _FORMAT_2.pack(
        b"PSOFSHD1", 2, header.shard_id, header.version, header.initialized, header.numel, header.arena_bytes,
        header.data_crc,
    )  # fmt: skip
    block = body + struct.pack("<I", crc32c.crc32c(body))
    return block + bytes(PAGE - len(block))


def downgrade_to_format_2(nvme_dir: Path) -> int:
    """Rewrites every model under `nvme_dir` (not open in a daemon) in format 2; returns how
    many slot headers were rewritten."""
    rewritten = 0
    for record_path in sorted(nvme_dir.glob("*.json")):
        record = json.loads(record_path.read_text())
        layout = record["layout"]
        with open(record_path.with_suffix(".arena"), "r+b") as f:
            for slot in range(layout["slots"]):
                f.seek(slot * layout["slot_bytes"])
                header = SlotHeader.unpack(f.read(PAGE))
                if header is None:
                    continue
                f.seek(slot * layout["slot_bytes"])
                f.write(format_2_header(header))
                rewritten += 1
        record_path.write_text(json.dumps({**record, "format": 2}, indent=1))
    return rewritten
