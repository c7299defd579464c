"""`make demo`: start a local ps-daemon, train the character GPT through it, show the shard
table, stop the daemon. Everything lives in a temporary directory and a free port."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import train_gpt  # noqa: E402


def start_daemon(workdir: Path) -> tuple[subprocess.Popen, str]:
    port_file = workdir / "port"
    log = open(workdir / "daemon.log", "w")  # noqa: SIM115 - lives as long as the daemon
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ps_daemon.cli",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(workdir / "state"),
            "--port-file",
            str(port_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            sys.exit(f"ps-daemon did not start:\n{(workdir / 'daemon.log').read_text()}")
        time.sleep(0.05)
    return daemon, f"127.0.0.1:{int(port_file.read_text())}"


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ps-demo-") as tmp:
        workdir = Path(tmp)
        daemon, address = start_daemon(workdir)
        print(f"ps-daemon started on {address} (state in {workdir})")
        try:
            losses = train_gpt.train(train_gpt.parse_args(["--daemons", address]))
            print("\n$ ps-admin shards --daemon", address)
            subprocess.run([sys.executable, "-m", "ps_daemon.admin", "shards", "--daemon", address], check=True)
            print("\n$ ps-admin stats --daemon", address)
            subprocess.run([sys.executable, "-m", "ps_daemon.admin", "stats", "--daemon", address], check=True)
        finally:
            daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(timeout=60)
            print(f"ps-daemon stopped (exit {code})")
        first, last = losses[0], sum(losses[-20:]) / 20
        if not last < first:
            print(f"demo failed: the loss did not fall ({first:.3f} -> {last:.3f})")
            return 1
        return code


if __name__ == "__main__":
    sys.exit(main())
