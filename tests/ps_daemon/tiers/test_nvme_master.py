"""The master region of a slot on a real file with O_DIRECT: every commit checksums it on its
own, `read_master` reads exactly it and nothing after it, a flipped byte is found by the
checksum that covers it, and files of format 2 (no master checksum) are still read."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ps_offload.daemon.model.spec import ModelSpec, ParamSpec, spec_from_dict, spec_to_dict
from ps_offload.daemon.tiers.nvme import (
    FORMAT_VERSION,
    PAGE,
    CorruptShard,
    DirectIO,
    NvmeFiles,
    SlotHeader,
    aligned_empty,
)
from ps_offload.optimizers import SGD
from tests.helpers.nvme_files import downgrade_to_format_2, format_2_header

SHARDS = 2
ARENA = 3 * PAGE
NUMEL = 1024  # master: the first page of each arena


def _files(directory) -> NvmeFiles:
    return NvmeFiles(directory, io=DirectIO(threads=2, block_bytes=PAGE), fsync=False, spare_slots=1)


def _model(directory) -> NvmeFiles:
    files = _files(directory)
    spec = ModelSpec("m", (ParamSpec("w", (SHARDS * NUMEL,)),), SGD(lr=0.1), NUMEL * 4, ("d",))
    files.create_model(spec_to_dict(spec), 0, {i: ARENA for i in range(SHARDS)})
    return files


def _arena(shard: int, version: int) -> memoryview:
    """Each page a different byte, so a read of the wrong page shows."""
    _, view = aligned_empty(ARENA)
    for page in range(ARENA // PAGE):
        view[page * PAGE : (page + 1) * PAGE] = bytes([64 * shard + 8 * version + page]) * PAGE
    return view


def _commit(files: NvmeFiles, shard: int, version: int, numel: int = NUMEL) -> None:
    files.commit("m", shard, _arena(shard, version), version=version, initialized=True, numel=numel)


def _read_master(files: NvmeFiles, shard: int) -> bytes:
    _, out = aligned_empty(ARENA)
    out[:] = b"\xaa" * ARENA
    files.read_master("m", *files.committed_slot("m", shard), out)
    assert out[PAGE:] == b"\xaa" * (ARENA - PAGE)  # nothing past the master region was read
    return bytes(out[:PAGE])


def _flip(directory, at: int) -> None:
    with open(directory / "m.arena", "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))


def test_a_commit_checksums_the_master_region_on_its_own_and_read_master_reads_only_it(tmp_path):
    files = _model(tmp_path)
    _commit(files, 0, 1)
    _commit(files, 1, 1)
    _commit(files, 0, 2)
    slot, header = files.committed_slot("m", 0)
    assert header.format == FORMAT_VERSION == 3 and header.master_bytes == PAGE
    read_before = files.bytes_read
    assert _read_master(files, 0) == bytes(_arena(0, 2)[:PAGE])
    assert _read_master(files, 1) == bytes(_arena(1, 1)[:PAGE])
    assert (files.master_reads, files.master_bytes_read) == (2, 2 * PAGE)
    assert files.bytes_read - read_before == 2 * PAGE  # counted with the loads' bytes
    # The header as it lies on disk says the same.
    with open(tmp_path / "m.arena", "rb") as f:
        f.seek(files.files["m"].offset(slot))
        assert SlotHeader.unpack(f.read(PAGE)) == header
    files.close()


def test_a_shard_of_an_odd_size_has_a_master_region_of_whole_pages(tmp_path):
    files = _model(tmp_path)
    _commit(files, 0, 1, numel=NUMEL + 1)  # one value into the second page
    _, header = files.committed_slot("m", 0)
    assert header.master_bytes == 2 * PAGE
    _, out = aligned_empty(ARENA)
    files.read_master("m", *files.committed_slot("m", 0), out)
    assert bytes(out[: 2 * PAGE]) == bytes(_arena(0, 1)[: 2 * PAGE])
    files.close()


def test_a_flipped_master_byte_fails_both_checksums_a_flipped_state_byte_only_the_whole(tmp_path):
    files = _model(tmp_path)
    _commit(files, 0, 1)
    _commit(files, 1, 1)
    at = {s: files.files["m"].offset(files.committed_slot("m", s)[0]) + PAGE for s in range(SHARDS)}
    _flip(tmp_path, at[0] + 100)  # shard 0: in its master values
    _flip(tmp_path, at[1] + PAGE + 100)  # shard 1: in its optimizer state
    _, out = aligned_empty(ARENA)
    with pytest.raises(CorruptShard, match="checksum mismatch in the master values of slot"):
        files.read_master("m", *files.committed_slot("m", 0), out)
    with pytest.raises(CorruptShard, match="checksum mismatch in slot"):
        files.load("m", 0, out)
    assert _read_master(files, 1) == bytes(_arena(1, 1)[:PAGE])  # its master values are intact
    with pytest.raises(CorruptShard, match="checksum mismatch in slot"):
        files.load("m", 1, out)
    assert files.master_reads == 1  # the failed read is not counted
    files.close()


def test_verify_checks_the_master_checksum_too(tmp_path):
    """A header whose master checksum is wrong while the whole arena's is right (a bug in
    whatever wrote it) is reported by check_slot: a master-only read would refuse the shard."""
    files = _model(tmp_path)
    _commit(files, 0, 1)
    slot, header = files.committed_slot("m", 0)
    _, buffer = files.check_buffer()
    assert files.check_slot("m", slot, header, buffer).problem == ""
    wrong = dataclasses.replace(header, master_crc=header.master_crc ^ 1)
    check = files.check_slot("m", slot, wrong, buffer)
    assert "the header in slot" in check.problem  # the header on disk is not this one
    with open(tmp_path / "m.arena", "r+b") as f:
        f.seek(files.files["m"].offset(slot))
        f.write(wrong.pack() + bytes(PAGE - len(wrong.pack())))
    check = files.check_slot("m", slot, wrong, buffer)
    assert check.problem.startswith(f"checksum mismatch in the master values of slot {slot}"), check.problem
    files.close()


def test_files_of_format_2_are_read_and_their_record_upgraded_before_any_commit(tmp_path):
    files = _model(tmp_path)
    _commit(files, 0, 1)
    _commit(files, 1, 1)
    _commit(files, 0, 2)
    files.close()
    assert downgrade_to_format_2(tmp_path) == 3  # shard 0's versions 1 and 2, shard 1's version 1

    files = _files(tmp_path)
    ((spec, _, layout),) = files.recorded_models(parse=spec_from_dict)
    headers, rolled_back = files.open_model(spec, layout, set(range(SHARDS)))
    assert rolled_back == {}
    assert {s: (h.version, h.format, h.master_crc) for s, h in headers.items()} == {0: (2, 2, None), 1: (1, 2, None)}
    # Read as before, whole; a master-only read needs the checksum format 2 has not.
    _, out = aligned_empty(ARENA)
    assert files.load("m", 0, out).version == 2 and bytes(out) == bytes(_arena(0, 2))
    with pytest.raises(ValueError, match="format 2, without a master checksum"):
        files.read_master("m", *files.committed_slot("m", 0), out)
    # Opening it made the record this release's, so the previous release refuses the file
    # rather than taking the format 3 headers written from now on for torn ones.
    assert json.loads((tmp_path / "m.json").read_text())["format"] == FORMAT_VERSION
    _commit(files, 1, 2)
    assert files.committed_slot("m", 1)[1].format == 3
    assert _read_master(files, 1) == bytes(_arena(1, 2)[:PAGE])
    files.close()

    # A file of both formats recovers each shard's newest version, whichever its format.
    files = _files(tmp_path)
    ((spec, _, layout),) = files.recorded_models(parse=spec_from_dict)
    headers, rolled_back = files.open_model(spec, layout, set(range(SHARDS)))
    assert rolled_back == {}
    assert {s: (h.version, h.format) for s, h in headers.items()} == {0: (2, 2), 1: (2, 3)}
    files.close()


def test_format_2_headers_unpack_as_the_previous_release_wrote_them():
    header = SlotHeader(3, 7, True, 1024, ARENA, 0x1234ABCD)
    assert header.format == 2
    assert header.pack() + bytes(PAGE - len(header.pack())) == format_2_header(header)
    assert SlotHeader.unpack(format_2_header(header)) == header
    torn = bytearray(format_2_header(header))
    torn[20] ^= 1
    assert SlotHeader.unpack(bytes(torn)) is None
