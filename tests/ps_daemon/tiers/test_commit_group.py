"""Group commit (ps_offload.daemon.tiers.commit_group) on a real O_DIRECT file: the commits that
queue while one group is written go to disk as the next group with two flushes in all; a write
that fails fails its own commit only, a flush that fails fails its whole group; and a process
SIGKILLed at each point of a group's commit recovers every shard whole, at its old version or
its new one, and never below what was acknowledged."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ps_offload.daemon.tiers.commit_group import CommitGroups
from ps_offload.daemon.tiers.crash_points import ENV, POINTS
from ps_offload.daemon.tiers.direct_io import DirectIO
from ps_offload.daemon.tiers.group_sync import GroupSync
from ps_offload.daemon.tiers.nvme import PAGE
from tests.helpers.group_commit import SHARDS, commit, create_files, recovered

REPO = Path(__file__).resolve().parents[3]


class _CountedGroups(CommitGroups):
    """CommitGroups that lets a test wait until `n` commits have queued."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = 0
        self.arrival = threading.Condition()

    def run(self, commit, write_group) -> None:
        with self.arrival:
            self.arrived += 1
            self.arrival.notify_all()
        super().run(commit, write_group)


def _threads(target, shards) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(s,)) for s in shards]
    for t in threads:
        t.start()
    return threads


def test_commits_queued_during_a_group_are_the_next_group_and_share_its_two_flushes(tmp_path):
    files = create_files(tmp_path)
    file = files.files["m"]
    groups = file.groups = _CountedGroups()
    release = threading.Event()

    def held_flush(fd: int) -> None:
        release.wait(timeout=60)  # the first group's first flush waits for the others to queue
        os.fdatasync(fd)

    file.flushes = GroupSync(file.fd, flush=held_flush, on_flush=files._flushed)
    first = _threads(lambda s: commit(files, s, 1), [0])
    with groups.arrival:
        assert groups.arrival.wait_for(lambda: groups.arrived == 1, timeout=60)
    rest = _threads(lambda s: commit(files, s, 1), range(1, SHARDS))
    with groups.arrival:
        assert groups.arrival.wait_for(lambda: groups.arrived == SHARDS, timeout=60)
    release.set()
    for t in first + rest:
        t.join(timeout=60)
    # One group of the first commit, one of the five that queued behind it: 4 flushes where a
    # flush pair per commit would be 12.
    assert (groups.groups, groups.commits) == (2, SHARDS)
    assert file.flushes.flushes == 4
    # The daemon's own counters (ps-admin stats, ps_nvme_*_total) say the same.
    assert (files.commits, files.commit_groups, files.flushes) == (SHARDS, 2, 4) and files.flush_seconds > 0
    files.close()
    assert recovered(tmp_path) == dict.fromkeys(range(SHARDS), 1)


def test_commits_one_at_a_time_are_groups_of_one_with_two_flushes_each(tmp_path):
    files = create_files(tmp_path)
    for shard in range(SHARDS):
        commit(files, shard, 1)
    # What the counters show an operator when a daemon's pushes arrive one by one: a group and
    # two flushes per commit, none shared.
    assert (files.commits, files.commit_groups, files.flushes) == (SHARDS, SHARDS, 2 * SHARDS)
    files.close()


def test_a_write_that_fails_fails_its_commit_alone(tmp_path, monkeypatch):
    files = create_files(tmp_path)
    for s in range(SHARDS):
        commit(files, s, 1)
    file = files.files["m"]
    free_before = len(file.free)
    failing = {file.offset(slot) + PAGE for slot in file.free}  # whichever slot shard 2 takes
    original = DirectIO._write_block
    taken: list[int] = []

    def write_block(fd, view, offset):
        if offset in failing and taken and offset == taken[0]:
            raise OSError(5, "Input/output error (injected)")
        original(fd, view, offset)

    monkeypatch.setattr(DirectIO, "_write_block", staticmethod(write_block))
    taken.append(file.offset(file.free[0]) + PAGE)  # the next slot taken is the one that fails
    with pytest.raises(OSError, match="injected"):
        commit(files, 2, 2)
    commit(files, 3, 2)
    assert len(file.free) == free_before  # the failed commit's slot was given back
    files.close()
    versions = recovered(tmp_path)
    assert versions[2] == 1 and versions[3] == 2  # shard 2 kept its committed version


def test_a_flush_that_fails_fails_every_commit_of_its_group_and_the_next_group_commits(tmp_path):
    files = create_files(tmp_path)
    file = files.files["m"]
    calls = []

    def flaky_flush(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error (injected)")
        os.fdatasync(fd)

    file.flushes = GroupSync(file.fd, flush=flaky_flush, on_flush=files._flushed)
    with pytest.raises(OSError, match="fdatasync failed"):
        commit(files, 0, 1)
    assert len(file.free) == 2 * SHARDS  # no header was written: its slot is free again
    commit(files, 0, 1)
    # The failed group committed nothing and counts in no figure; its flush ran, and counts.
    assert (files.commits, files.commit_groups, files.flushes) == (1, 1, 3)
    files.close()
    assert recovered(tmp_path) == {0: 1}


CHILD = """
import sys, threading
from pathlib import Path
from tests.helpers.group_commit import SHARDS, commit, files_on
from ps_offload.daemon.model.spec import spec_from_dict
files = files_on(Path(sys.argv[1]))
(spec, _, layout) = files.recorded_models(parse=spec_from_dict)[0]
files.open_model(spec, layout, set(range(SHARDS)))
acknowledged = open(sys.argv[2], "a", buffering=1)
def push(s):
    commit(files, s, 2)
    acknowledged.write(f"{s}\\n")  # what a push's answer would say: committed
threads = [threading.Thread(target=push, args=(s,)) for s in range(SHARDS)]
[t.start() for t in threads]
[t.join() for t in threads]
"""


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_each_point_of_a_group_commit_recovers_every_shard_whole(tmp_path, point):
    files = create_files(tmp_path)
    for s in range(SHARDS):
        commit(files, s, 1)
    files.close()
    acknowledged = tmp_path / "acknowledged"
    env = {**os.environ, ENV: f"{point}@2", "PYTHONPATH": str(REPO)}  # the second group to reach it
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), str(acknowledged)], env=env, cwd=REPO, timeout=120
    )
    assert result.returncode == -9  # SIGKILL at the point, mid-way through the shards
    versions = recovered(tmp_path)
    assert set(versions) == set(range(SHARDS)) and set(versions.values()) <= {1, 2}
    acked = {int(line) for line in acknowledged.read_text().split()} if acknowledged.exists() else set()
    assert all(versions[s] == 2 for s in acked)  # nothing acknowledged is lost
    # The first group was written whole before the second began (its acknowledgements may not
    # have been printed yet); the second, killed before its headers, left its shards at 1.
    assert 2 in versions.values()
    if POINTS.index(point) < POINTS.index("header_written"):
        assert 1 in versions.values()
