"""What every benchmark shares: timing, the result record, and starting a daemon.

Each script measures our figure and its peer in the same run, interleaved, and reports the
ratio: these machines are noisy, so absolute times mean little and the ratio is the figure.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def interleaved(
    ours: Callable[[], object], peer: Callable[[], object], *, reps: int, warmup: int = 1
) -> tuple[list[float], list[float]]:
    """Runs ours and peer alternately, in ABBA order (so drift in the machine and whatever
    the first of a pair leaves in caches hit both alike), after warm-up."""
    for _ in range(warmup):
        ours()
        peer()
    ours_times, peer_times = [], []
    for rep in range(reps):
        if rep % 2 == 0:
            ours_times.append(timed(ours))
            peer_times.append(timed(peer))
        else:
            peer_times.append(timed(peer))
            ours_times.append(timed(ours))
    return ours_times, peer_times


def record(
    name: str,
    *,
    ours: float,
    peer: float,
    unit: str,
    target: float,
    higher_is_better: bool,
    ratio: float | None = None,
    notes: str = "",
    extra: dict | None = None,
) -> dict:
    """Writes bench/results/NAME.json and prints one line. `ratio` defaults to ours/peer."""
    ratio = ours / peer if ratio is None else ratio
    met = ratio >= target if higher_is_better else ratio <= target
    result = {
        "name": name,
        "ours": round(ours, 4),
        "peer": round(peer, 4),
        "unit": unit,
        "ratio": round(ratio, 3),
        "target": target,
        "higher_is_better": higher_is_better,
        "date": datetime.date.today().isoformat(),
        "target_met": met,
        "machine": f"{platform.machine()}, {_cores()} cores",
        "notes": notes,
        **(extra or {}),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{name}: ours {ours:.4g} {unit}, peer {peer:.4g} {unit}, ratio {ratio:.3f} "
        f"(target {'>=' if higher_is_better else '<='} {target}: {'met' if met else 'NOT met'})"
    )
    return result


def _cores() -> int:
    import os

    return os.cpu_count() or 0


def median(values: list[float]) -> float:
    return statistics.median(values)


class LocalDaemon:
    """A ps-daemon subprocess on a free loopback port, in a temporary directory."""

    def __init__(self, *extra: str) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="ps-bench-")
        tmp = Path(self._tmp.name)
        port_file = tmp / "port"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ps_daemon.cli",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--state-dir",
                str(tmp / "state"),
                "--port-file",
                str(port_file),
                "--log-level",
                "WARNING",
                *extra,
            ],
            cwd=REPO,
        )
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ps-daemon did not start")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{int(port_file.read_text())}"

    def __enter__(self) -> LocalDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self._tmp.cleanup()
