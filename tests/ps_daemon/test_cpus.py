"""server.cpus, server.scheduling and store.optimizer_threads (ps_daemon/cpus.py): the list's
format, the default that leaves a core per GPU of the host, and a real daemon confined to the
CPUs named, its threads at the policy named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ps_offload.daemon import cpus
from ps_offload.daemon.config import ConfigError, load_config, parse_cpu_list
from ps_offload.daemon.local import LocalDaemon


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,3", {0, 1, 3}), (" 2 , 0 ", {0, 2}), ("4-4", {4})],
)
def test_cpu_lists_read_as_taskset_writes_them(text, expected):
    assert parse_cpu_list(text) == expected
    assert parse_cpu_list(cpus.format_cpu_list(frozenset(expected))) == expected


@pytest.mark.parametrize(("text", "says"), [("0-x", "'0-x' is not a CPU"), ("3-1", "runs backwards"), ("", "''")])
def test_a_bad_cpu_list_is_refused_at_load(tmp_path, text, says):
    path = tmp_path / "daemon.toml"
    path.write_text(f'[server]\ncpus = "{text},1"\n' if text else '[server]\ncpus = ","\n')
    with pytest.raises(ConfigError, match="server.cpus") as refused:
        load_config(path)
    assert says in str(refused.value)


def test_an_unknown_scheduling_is_refused_at_load(tmp_path):
    path = tmp_path / "daemon.toml"
    path.write_text('[server]\nscheduling = "low"\n')
    with pytest.raises(ConfigError, match="server.scheduling must be one of 'normal', 'idle', got 'low'"):
        load_config(path)


def test_the_plan_says_whether_the_threads_yield():
    assert not cpus.plan("", 1).idle
    assert not cpus.plan("", 1, "normal").idle
    assert cpus.plan("", 1, "idle").idle
    assert cpus.plan("", 1, "idle").describe().endswith(", 1 optimizer threads, at SCHED_IDLE")


def test_the_optimizer_leaves_a_core_per_gpu_of_the_host(monkeypatch):
    allowed = frozenset(os.sched_getaffinity(0))
    monkeypatch.setattr(cpus, "host_gpus", lambda: 0)
    assert cpus.plan("", 0) == cpus.CpuPlan(allowed, len(allowed))
    monkeypatch.setattr(cpus, "host_gpus", lambda: 1)
    assert cpus.plan("", 0).optimizer_threads == max(1, len(allowed) - 1)
    monkeypatch.setattr(cpus, "host_gpus", lambda: 64)
    assert cpus.plan("", 0).optimizer_threads == 1
    assert cpus.plan("", 5).optimizer_threads == 5  # as set


def test_a_cpu_the_daemon_may_not_run_on_is_named():
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(OSError, match=f"names CPUs {outside} this daemon may not run on"):
        cpus.plan(str(outside), 0)


def _policies(pid: int) -> set[int]:
    """Each thread's scheduling policy (os.SCHED_OTHER, os.SCHED_IDLE, ...)."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(os.sched_getscheduler(int(tid)))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return found


def _allowed_cpus(pid: int) -> set[str]:
    """Each thread's Cpus_allowed_list."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found.add(line.split(":", 1)[1].strip())
    return found


def test_every_thread_of_a_daemon_runs_on_its_cpus(tmp_path):
    first = min(os.sched_getaffinity(0))
    config = tmp_path / "daemon.toml"
    config.write_text(f'[server]\ncpus = "{first}"\n[store]\noptimizer_threads = 1\n')
    daemon = LocalDaemon(tmp_path / "d", "--config", str(config))
    try:
        assert _allowed_cpus(daemon.process.pid) == {str(first)}
        assert f"running on 1 CPUs ({first}), 1 optimizer threads\n" in daemon.log()
        assert _policies(daemon.process.pid) == {os.SCHED_OTHER}  # server.scheduling's default
    finally:
        daemon.stop()


def test_every_thread_of_an_idle_daemon_is_at_sched_idle(tmp_path):
    """Set in the main thread before the servers start, and inherited by every thread they
    start (gRPC's, the data plane's, the local transport's, the optimizer's)."""
    config = tmp_path / "daemon.toml"
    config.write_text('[server]\nscheduling = "idle"\n[store]\noptimizer_threads = 1\n')
    daemon = LocalDaemon(tmp_path / "d", "--config", str(config))
    try:
        threads = os.listdir(f"/proc/{daemon.process.pid}/task")
        assert len(threads) > 3
        assert _policies(daemon.process.pid) == {os.SCHED_IDLE}
        assert "1 optimizer threads, at SCHED_IDLE" in daemon.log()
    finally:
        daemon.stop()


def test_a_daemon_given_a_cpu_not_its_own_does_not_start(tmp_path):
    config = tmp_path / "daemon.toml"
    config.write_text(f'[server]\ncpus = "{max(os.sched_getaffinity(0)) + 1}"\n')
    with pytest.raises(RuntimeError, match="exited with 1") as refused:
        LocalDaemon(tmp_path / "d", "--config", str(config))
    assert "this daemon may not run on" in str(refused.value)
