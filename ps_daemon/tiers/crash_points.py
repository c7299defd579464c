"""Testing aid: `PS_OFFLOAD_CRASH_AT=POINT@N` kills the daemon with SIGKILL (no cleanup, as a
power cut or the OOM killer would) the N-th time any commit reaches POINT of the commit
protocol (ps_offload.daemon.tiers.nvme), so that `make soak` and the tests can crash it at each point
on purpose rather than hoping a random kill lands there. Unset: one dictionary lookup per point."""

from __future__ import annotations

import os
import signal
import threading

ENV = "PS_OFFLOAD_CRASH_AT"
# In commit order: nothing written; the bytes written, not synced; synced; the header written,
# not synced; the header synced (committed on disk, not yet acknowledged).
POINTS = ("before_data", "data_written", "data_synced", "header_written", "header_synced")


def _parse(setting: str | None) -> tuple[str, int] | None:
    if not setting:
        return None
    point, _, count = setting.partition("@")
    if point not in POINTS:
        raise ValueError(f"{ENV}={setting!r}: the point must be one of {', '.join(POINTS)}")
    return point, int(count or 1)


_target = _parse(os.environ.get(ENV))
_reached = 0
_lock = threading.Lock()


def reached(point: str) -> None:
    """Called at each point of a commit; kills the process when it is the one asked for."""
    global _reached
    if _target is None or point != _target[0]:
        return
    with _lock:
        _reached += 1
        if _reached >= _target[1]:
            os.kill(os.getpid(), signal.SIGKILL)
