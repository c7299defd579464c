"""nvme_train_step: training steps of a model whose AdamW state (120 MB) is 1.9x the daemon's
RAM tier (64 MiB), with prefetch (the trainer's end-of-step hints and the daemon's learned
order) on and off, and the same model all in RAM.

Each step moves the state over the disk: every committed version is written (write-through)
and evicted shards are read back. The figure is the bytes moved per step over the step
time, against fio moving the same mix of reads and writes (sequential, O_DIRECT, in the same
directory; this disk serves reads and writes concurrently, so the mix is the fair peer, not
the sum of separate read and write times), run right after each of ours. Target >= 0.8. The step times with prefetch,
without, and all in RAM are reported beside it.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.common import REPO, daemon_stats, median, record, timed
from bench.nvme_io import _fio
from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon

RAM_BYTES = 64 << 20
SHARD_BYTES = 4 << 20  # 12 MiB arenas: the tier holds 5
WARMUP, STEPS = 2, 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10),
    )  # fmt: skip


def _fio_mixed(directory: Path, nbytes: int, read_percent: int) -> float:
    """fio's combined GB/s for a sequential O_DIRECT mix of reads and writes, as a step makes."""
    out = subprocess.run(
        [
            "fio", "--name=mix", f"--filename={directory / 'fio.dat'}", "--rw=rw", f"--rwmixread={read_percent}",
            "--bs=8M", f"--size={nbytes}", "--direct=1", "--ioengine=libaio", "--iodepth=8", "--end_fsync=1",
            "--output-format=json",
        ],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    job = json.loads(out)["jobs"][0]
    return (job["read"]["bw_bytes"] + job["write"]["bw_bytes"]) / 1e9


def _run(workdir: Path, *flags: str, hints: bool = True) -> tuple[float, float, float]:
    """Median step time and per-step NVMe bytes read and written, for a daemon with flags."""
    model = _model()
    x, y = torch.randn(16, 2048), torch.randint(10, (16,))
    with LocalDaemon(workdir, "--log-level", "WARNING", *flags) as daemon:
        opt = trainer.offload(
            model,
            daemons=[daemon.address],
            optimizer=trainer.AdamW(lr=1e-4),
            shard_bytes=SHARD_BYTES,
            config=trainer.ClientConfig(prefetch_hints=hints),
        )

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.synchronize()

        for _ in range(WARMUP):
            step()
        before = daemon_stats(daemon.address)
        times = [timed(step) for _ in range(STEPS)]
        after = daemon_stats(daemon.address)
        opt.close()
    read = (after.nvme_bytes_read - before.nvme_bytes_read) / STEPS
    written = (after.nvme_bytes_written - before.nvme_bytes_written) / STEPS
    return median(times), read, written


def main() -> dict:
    n_params = sum(p.numel() for p in _model().parameters())
    state = 12 * n_params
    with tempfile.TemporaryDirectory(prefix="ps-bench-train-", dir=REPO) as tmp:
        root = Path(tmp)
        (root / "no-prefetch.toml").write_text("[store]\nprefetch_depth = 0\n")
        nvme = ["--ram-bytes", str(RAM_BYTES), "--nvme-dir"]
        fio_dir = root / "fio"
        fio_dir.mkdir()
        probe = 2 * state  # a step reads and writes about the state once each
        _fio(fio_dir, "write", probe)  # lay the file out first
        # Runs with and without prefetch alternate, ABBA, each on a fresh daemon and each
        # followed by fio: this disk's speed drifts by tens of percent within minutes, so
        # each run is compared with the fio run beside it, and the ratios' median is the figure.
        runs: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        ratios = []
        for rep, prefetch in enumerate([True, False, False, True, True, False]):
            flags = [*nvme, str(root / f"nvme{rep}")]
            if not prefetch:
                flags += ["--config", str(root / "no-prefetch.toml")]
            run = _run(root / f"run{rep}", *flags, hints=prefetch)
            runs[prefetch].append(run)
            fio = _fio_mixed(fio_dir, probe, 50)
            if prefetch:
                step_time, read, written = run
                ratios.append(((read + written) / step_time / 1e9, fio))
        t_pf = median([t for t, _, _ in runs[True]])
        t_nopf = median([t for t, _, _ in runs[False]])
        read = median([r for _, r, _ in runs[True]])
        written = median([w for _, _, w in runs[True]])
        t_ram, _, _ = _run(root / "ram")
    ratio = median([ours / peer for ours, peer in ratios])
    return record(
        "nvme_train_step",
        ours=median([ours for ours, _ in ratios]),
        peer=median([peer for _, peer in ratios]),
        ratio=ratio,
        unit="GB/s moved",
        target=0.8,
        higher_is_better=True,
        notes=f"{n_params / 1e6:.1f}M params, {state >> 20} MiB AdamW state, RAM tier {RAM_BYTES >> 20} MiB, "
        f"{SHARD_BYTES >> 20} MiB shards; per step {read / 2**20:.0f} MiB read + {written / 2**20:.0f} MiB written; "
        "peer: fio sequential O_DIRECT, half reads, half writes, run right after each of ours; median of 3 "
        f"paired ratios, runs of {STEPS} steps, with and without prefetch alternating",
        extra={
            "step_ms_nvme_prefetch": round(1000 * t_pf, 1),
            "step_ms_nvme_no_prefetch": round(1000 * t_nopf, 1),
            "step_ms_all_in_ram": round(1000 * t_ram, 1),
            "paired": [[round(o, 3), round(p, 3)] for o, p in ratios],
        },
    )


if __name__ == "__main__":
    main()
