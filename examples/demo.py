"""`make demo`: start a local ps-daemon, train the character GPT through it, show the shard
table, stop the daemon. Everything lives in a temporary directory and a free port."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import train_gpt  # noqa: E402

from ps_offload.daemon.local import LocalDaemon  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ps-demo-") as tmp:
        workdir = Path(tmp)
        try:
            daemon = LocalDaemon(workdir)
        except RuntimeError as exc:
            sys.exit(str(exc))
        address = daemon.address
        print(f"ps-daemon started on {address} (state in {workdir})")
        try:
            losses = train_gpt.train(train_gpt.parse_args(["--daemons", address]))
            print("\n$ ps-admin shards --daemon", address)
            subprocess.run([sys.executable, "-m", "ps_offload.admin", "shards", "--daemon", address], check=True)
            print("\n$ ps-admin stats --daemon", address)
            subprocess.run([sys.executable, "-m", "ps_offload.admin", "stats", "--daemon", address], check=True)
        finally:
            code = daemon.stop()
            print(f"ps-daemon stopped (exit {code})")
        first, last = losses[0], sum(losses[-20:]) / 20
        if not last < first:
            print(f"demo failed: the loss did not fall ({first:.3f} -> {last:.3f})")
            return 1
        return code


if __name__ == "__main__":
    sys.exit(main())
