"""Shared fixtures: real daemons as subprocesses on 127.0.0.1, port 0, in temporary dirs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass
class DaemonProcess:
    process: subprocess.Popen
    port: int
    state_dir: Path
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def start_daemon(tmp: Path, *extra: str, config: Path | None = None, timeout: float = 60.0) -> DaemonProcess:
    """Starts `ps-daemon serve` on a free port and waits until it has written its port."""
    tmp.mkdir(parents=True, exist_ok=True)
    port_file = tmp / "port"
    log_path = tmp / "daemon.log"
    cmd = [
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
        *extra,
    ]
    if config is not None:
        cmd += ["--config", str(config)]
    log_file = open(log_path, "w")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ})
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"ps-daemon exited with {process.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"ps-daemon did not start in {timeout}s:\n{log_path.read_text()}")
        time.sleep(0.05)
    return DaemonProcess(process, int(port_file.read_text()), tmp / "state", log_path)


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def factory(*extra: str, config: Path | None = None) -> DaemonProcess:
        daemon = start_daemon(tmp_path / f"daemon{len(started)}", *extra, config=config)
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        if daemon.process.poll() is None:
            daemon.process.kill()
            daemon.process.wait()


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory()
