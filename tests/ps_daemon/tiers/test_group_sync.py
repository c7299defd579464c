"""GroupSync (ps_daemon/tiers/group_sync.py): commits running at once share their flushes, and
none returns before a flush that began after its call completed; a failed flush fails every
commit it was to cover."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from ps_offload.daemon.tiers.group_sync import GroupSync


class Disk:
    """A flush that logs when it begins and ends, and can be held at its start."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.hold = threading.Event()
        self.hold.set()
        self.started = threading.Event()
        self.fail_next = False

    def flush(self, fd: int) -> None:
        with self.lock:
            number = sum(1 for kind, _ in self.log if kind == "begin") + 1
            self.log.append(("begin", number))
            fail, self.fail_next = self.fail_next, False
        self.started.set()
        self.hold.wait(60)
        with self.lock:
            self.log.append(("end", number))
        if fail:
            raise OSError(errno.EIO, "injected")

    def mark(self) -> int:
        with self.lock:
            return len(self.log)

    def covered(self, since: int, until: int) -> bool:
        """Whether a flush begun after log index `since` ended before index `until`."""
        with self.lock:
            begun = {n for kind, n in self.log[since:until] if kind == "begin"}
            return any(kind == "end" and n in begun for kind, n in self.log[since:until])


def _caller(sync: GroupSync, disk: Disk, results: list, errors: list) -> None:
    since = disk.mark()
    try:
        sync.sync()
    except OSError as exc:
        errors.append(exc)
        return
    results.append(disk.covered(since, disk.mark()))


def _until(predicate) -> None:
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, "the callers never arrived"
        threading.Event().wait(0.01)


def _during_a_held_flush(disk: Disk, sync: GroupSync, waiting: int, *, fail_next: bool = False) -> tuple[list, list]:
    """One commit whose flush is held, `waiting` more arriving meanwhile; then all run out.
    Returns (results, errors) of _caller."""
    results, errors = [], []
    disk.hold.clear()
    first = threading.Thread(target=_caller, args=(sync, disk, results, errors))
    first.start()
    assert disk.started.wait(60)  # flush 1 runs, held
    disk.fail_next = fail_next  # the flush the waiters share
    others = [threading.Thread(target=_caller, args=(sync, disk, results, errors)) for _ in range(waiting)]
    for t in others:
        t.start()
    _until(lambda: sync.calls == waiting + 1)  # every caller is in sync()
    disk.hold.set()
    for t in [first, *others]:
        t.join(60)
    return results, errors


def test_commits_that_arrive_during_a_flush_share_the_next_one():
    disk = Disk()
    told: list[float] = []  # what the daemon's counters are given (ps_nvme_flushes_total)
    sync = GroupSync(3, flush=disk.flush, on_flush=told.append)
    results, errors = _during_a_held_flush(disk, sync, 6)
    assert not errors and results == [True] * 7  # each saw a flush begun after its call end
    assert sync.flushes == 2  # 7 commits, 2 flushes: the one running, and one for the six
    assert len(told) == 2 and sum(told) == pytest.approx(sync.seconds) and min(told) > 0


def test_every_caller_waits_for_a_flush_begun_after_it_under_contention():
    disk = Disk()
    sync = GroupSync(3, flush=disk.flush)
    results, errors = [], []
    threads = [
        threading.Thread(target=lambda: [_caller(sync, disk, results, errors) for _ in range(50)]) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 400 and all(results)
    assert sync.flushes <= 400


def test_a_failed_flush_fails_every_commit_it_covered_and_the_next_one_succeeds():
    disk = Disk()
    sync = GroupSync(3, flush=disk.flush)
    results, errors = _during_a_held_flush(disk, sync, 3, fail_next=True)  # flush 2, theirs, fails
    assert results == [True] and len(errors) == 3
    assert all(e.errno == errno.EIO and "fdatasync failed" in str(e) for e in errors)
    sync.sync()  # a later commit gets a flush of its own
    with pytest.raises(OSError):
        disk.fail_next = True
        sync.sync()
