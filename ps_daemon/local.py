"""A ps-daemon as a child process on a free loopback port: what the demo, the tests and the
benchmarks start. Production daemons run under systemd instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class LocalDaemon:
    """`ps-daemon serve` on 127.0.0.1, port 0, files under `workdir`, output to
    `workdir/daemon.log`. Construction returns once the daemon listens."""

    def __init__(
        self,
        workdir: Path,
        *extra: str,
        start_timeout: float = 60.0,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
        wait: bool = True,
    ) -> None:
        """`env`: variables added to the daemon's environment (the fault injections' settings).
        `host`: the address it listens on; `launcher`: a command it runs under (`ip netns exec
        NAME` for the network fault tests: bench/netns.py). `wait=False` returns at once: call
        `wait_listening()` before `address` (several daemons then start side by side, each
        paying torch's ~3 s import at once rather than in turn)."""
        self.host = host
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.log_path = workdir / "daemon.log"
        if "--nvme-dir" in extra:  # as an operator would mkdir it: the daemon refuses a missing one
            Path(extra[extra.index("--nvme-dir") + 1]).mkdir(parents=True, exist_ok=True)
        port_file = workdir / "port"
        port_file.unlink(missing_ok=True)  # a reused workdir's port file is an earlier daemon's
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [*launcher, sys.executable, "-m", "ps_offload.daemon.cli", "serve", "--listen", f"{host}:0",
                 "--port-file", str(port_file), *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env} if env else None,
            )  # fmt: skip
        self._port_file, self._deadline = port_file, time.monotonic() + start_timeout
        self._start_timeout = start_timeout
        self.port: int | None = None
        if wait:
            self.wait_listening()

    def wait_listening(self) -> LocalDaemon:
        """Returns once the daemon listens (its port file written); raises with its log if it
        exited or did not start in time."""
        while self.port is None:
            if self._port_file.exists():
                self.port = int(self._port_file.read_text())
                break
            if self.process.poll() is not None:
                raise RuntimeError(f"ps-daemon exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > self._deadline:
                self.process.kill()
                raise RuntimeError(f"ps-daemon did not start in {self._start_timeout:.0f}s:\n{self.log()}")
            time.sleep(0.05)
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Sends `sig` (SIGTERM: drain and exit 0) and returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> LocalDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
