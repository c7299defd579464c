"""The committed-version record (ps_offload.daemon.tiers.version_floors): floors only rise, the file
round-trips, and a torn, flipped or foreign file is reported, never trusted."""

from __future__ import annotations

import logging

import pytest

from ps_offload.daemon.tiers.version_floors import FloorWriter, VersionFloors


def test_floors_only_rise_and_round_trip(tmp_path):
    floors = VersionFloors(tmp_path / "m.versions")
    floors.raise_to(3, 7)
    floors.raise_to(3, 5)  # a late, lower report never lowers the floor
    floors.raise_to(0, 1)
    floors.write()
    loaded, problem = VersionFloors.load(tmp_path / "m.versions")
    assert problem == "" and (loaded.get(3), loaded.get(0), loaded.get(9)) == (7, 1, 0)


def test_missing_file_is_no_floors_and_no_problem(tmp_path):
    loaded, problem = VersionFloors.load(tmp_path / "absent.versions")
    assert problem == "" and loaded.get(0) == 0


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda b: b[:-3], "bytes for"),
        (lambda b: b[:5], "too short"),
        (lambda b: b"X" + b[1:], "not a floors file"),
        (lambda b: b[:14] + bytes([b[14] ^ 1]) + b[15:], "checksum mismatch"),
    ],
)
def test_damaged_file_is_reported_and_gives_no_floors(tmp_path, damage, why):
    path = tmp_path / "m.versions"
    floors = VersionFloors(path)
    floors.raise_to(1, 4)
    floors.write()
    path.write_bytes(damage(path.read_bytes()))
    loaded, problem = VersionFloors.load(path)
    assert why in problem and str(path) in problem and loaded.get(1) == 0


def test_a_failed_write_is_retried_by_the_next(tmp_path):
    path = tmp_path / "gone" / "m.versions"  # no such directory: the write fails
    floors = VersionFloors(path)
    floors.raise_to(0, 2)
    with pytest.raises(OSError):
        floors.write()
    path.parent.mkdir()
    floors.write()  # still dirty, so written now
    assert VersionFloors.load(path)[0].get(0) == 2


def test_writer_logs_failures_once_and_writes_at_stop(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ps_offload.daemon.tiers.version_floors")
    broken = VersionFloors(tmp_path / "gone" / "a.versions")
    broken.raise_to(0, 1)
    good = VersionFloors(tmp_path / "b.versions")
    writer = FloorWriter(lambda: [broken, good], interval=3600)  # only the explicit writes below
    good.raise_to(0, 9)
    writer.write_all()
    writer.write_all()
    assert caplog.text.count("recording committed versions failed") == 1
    (tmp_path / "gone").mkdir()
    good.raise_to(0, 10)
    writer.stop()
    assert "works again" in caplog.text
    assert VersionFloors.load(tmp_path / "b.versions")[0].get(0) == 10
    assert VersionFloors.load(tmp_path / "gone" / "a.versions")[0].get(0) == 1


def test_a_retired_record_is_never_written_again(tmp_path):
    """A dropped model's record: the writer thread must not bring the file back."""
    floors = VersionFloors(tmp_path / "m.versions")
    floors.raise_to(0, 3)
    floors.retire()
    floors.write()
    assert not (tmp_path / "m.versions").exists()
