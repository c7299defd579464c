"""A daemon killed at each point of the commit protocol (PS_OFFLOAD_CRASH_AT, ps_offload.daemon.tiers.
crash_points) while a trainer trains through it: each restart recovers, the trainer's retries
carry on, and the run ends bit-identical to torch.optim.AdamW in process."""

from __future__ import annotations

import signal
import threading

import pytest

from ps_offload.daemon.local import LocalDaemon
from ps_offload.daemon.tiers.crash_points import ENV, POINTS
from tests.helpers.persistence_run import (
    assert_same_parameters,
    classifier_case,
    fused_adamw_reference,
    offload_adamw,
    train_and_synchronize,
)

# Two runs of a few points each, not one of all five: each restart costs a daemon's start-up
# (~5 s, more on a loaded machine) and the trainer's retry, and one test must fit its timeout.
POINT_RUNS = [POINTS[:3], POINTS[3:]]


@pytest.mark.parametrize("points", POINT_RUNS, ids=["-".join(run) for run in POINT_RUNS])
def test_a_crash_at_every_point_of_a_commit_loses_nothing(tmp_path, points):
    assert sorted(p for run in POINT_RUNS for p in run) == sorted(POINTS)  # every point in one run
    nvme = tmp_path / "nvme"
    model, batches = classifier_case()
    reference = fused_adamw_reference(model, batches)

    def start(name: str, point: str | None = None, *extra: str) -> LocalDaemon:
        env = {ENV: f"{point}@3"} if point else None  # the 3rd commit to reach it: mid-step
        return LocalDaemon(tmp_path / name, "--nvme-dir", str(nvme), *extra, env=env)

    daemons = [start("first", points[0])]
    listen = ("--listen", f"127.0.0.1:{daemons[0].port}")  # restarted on the port the trainer knows
    deaths: list[int] = []

    def restarter() -> None:
        for next_point in (*points[1:], None):
            deaths.append(daemons[-1].process.wait(timeout=300))  # it kills itself at its point
            daemons.append(start(f"after{len(deaths)}", next_point, *listen))

    try:
        thread = threading.Thread(target=restarter)
        thread.start()
        with offload_adamw(model, daemons[0].address) as opt:
            train_and_synchronize(opt, model, batches)
        thread.join(timeout=300)
        assert deaths == [-signal.SIGKILL] * len(points)  # each died at its point, by SIGKILL
        assert_same_parameters(model, reference)
    finally:
        for daemon in daemons:
            daemon.kill()
