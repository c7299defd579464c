"""`make bench-scale`: AdamW state twice this machine's physical RAM, trained through one
daemon with an NVMe tier for a few steps; reports the step time and the bytes moved per
second against fio on the same disk with the same mix of reads and writes.

At this size the trainer cannot hold the model either (its fp32 parameters and gradients
alone are 8 bytes per parameter), so this trainer streams: it pushes a gradient for each
shard and pulls the shard's new values back, two shards in flight, holding only those.
The gradients are synthetic (one fixed random buffer): the figure is the daemon's, since
reading, updating and writing the state is what bounds a step at this size. The first
shard is then checked against torch's fused AdamW run in this process on the same values.

Each step is paired with an fio run (sequential O_DIRECT, libaio, the step's read/write mix)
next to it in time, in ABBA order (step then fio, fio then step, ...): this disk's speed
drifts by tens of percent within minutes. The figure is the median of the per-pair ratios,
and their spread is in the result file. fio moves 4 GiB in a 4 GiB file per run, not a
step's 100 GB: a file of the arena's size would need twice the disk this machine has.

It checks free disk and memory first and says what it needs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import REPO, daemon_stats, median, quick, record, spread
from bench.nvme_io import fio_seconds
from ps_offload.daemon.local import LocalDaemon
from ps_offload.daemon.optim import AdamWConfig
from ps_offload.daemon.store import shard_resident_bytes
from ps_offload.daemon.tiers.nvme import FileLayout
from ps_offload.proto import ps_pb2
from ps_offload.trainer.client import ShardedClient
from ps_offload.trainer.config import ClientConfig

SHARD_NUMEL = 64 << 20  # 256 MiB of fp32 master per shard; one parameter per shard
RAM_TIER = 4 << 30
SPARE_SLOTS = 2  # as many as commits in flight (two streams)
FIO_BYTES = quick(4 << 30, 256 << 20)
MARGIN = 2 << 30
ADAMW = AdamWConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _meminfo(key: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def plan(ram_multiple: float) -> tuple[int, int, int]:
    """(shards, parameters, disk bytes needed) for state `ram_multiple` x physical RAM."""
    state_per_param = 12  # fp32 master, m, v
    params_needed = int(ram_multiple * _meminfo("MemTotal") / state_per_param) + 1
    shards = -(-params_needed // SHARD_NUMEL)
    arena = shard_resident_bytes(SHARD_NUMEL, ADAMW)
    layout = FileLayout.for_shards(dict.fromkeys(range(shards), arena), spare_slots=SPARE_SLOTS)
    return shards, shards * SHARD_NUMEL, layout.size + FIO_BYTES + MARGIN


def check_room(workdir: Path, disk_needed: int) -> None:
    free = shutil.disk_usage(workdir).free
    if free < disk_needed:
        raise SystemExit(
            f"bench-scale: needs {disk_needed / 1e9:.1f} GB free under {workdir} (the model's arena file, "
            f"fio's probe file and a margin); {free / 1e9:.1f} GB are free. Free space, or pass a smaller "
            "--ram-multiple (the issue asks for 2)"
        )
    need_ram = RAM_TIER + 6 * SHARD_NUMEL * 4 + (1 << 30)
    if _meminfo("MemAvailable") < need_ram:
        raise SystemExit(f"bench-scale: needs {need_ram / 2**30:.1f} GiB of available memory")


def _reference(init: torch.Tensor, grad: torch.Tensor, steps: int) -> torch.Tensor:
    param = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW(
        [param], lr=ADAMW.lr, betas=(ADAMW.beta1, ADAMW.beta2), eps=ADAMW.eps, weight_decay=ADAMW.weight_decay,
        fused=True,
    )  # fmt: skip
    for _ in range(steps):
        param.grad = grad
        opt.step()
    return param.detach()


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ram-multiple", type=float, default=2.0, help="state size over physical RAM")
    parser.add_argument("--steps", type=int, default=5, help="steps, each paired with an fio run")
    parser.add_argument("--check-only", action="store_true", help="print what it needs and exit")
    args = parser.parse_args()

    shards, n_params, disk_needed = plan(args.ram_multiple)
    state = 12 * n_params
    print(
        f"bench-scale: {n_params / 1e9:.2f}B parameters, {state / 1e9:.1f} GB of AdamW state "
        f"({state / _meminfo('MemTotal'):.2f}x this machine's {_meminfo('MemTotal') / 2**30:.1f} GiB of RAM), "
        f"{shards} shards of {SHARD_NUMEL * 4 >> 20} MiB, RAM tier {RAM_TIER >> 30} GiB; "
        f"needs {disk_needed / 1e9:.1f} GB of disk"
    )
    check_room(REPO, disk_needed)
    if args.check_only:
        return {}

    torch.manual_seed(0)
    init = torch.randn(SHARD_NUMEL) * 0.02
    grad = torch.randn(SHARD_NUMEL) * 1e-3
    init_bytes = memoryview(init.numpy()).cast("B")
    grad_bytes = memoryview(grad.numpy()).cast("B")
    config = ClientConfig(rpc_timeout_seconds=600, streams_per_daemon=2)

    with tempfile.TemporaryDirectory(prefix="ps-bench-scale-", dir=REPO) as tmp:
        root = Path(tmp)
        (root / "daemon.toml").write_text(f"[store]\nnvme_spare_slots = {SPARE_SLOTS}\n")
        daemon = LocalDaemon(
            root / "daemon", "--log-level", "WARNING", "--config", str(root / "daemon.toml"),
            "--nvme-dir", str(root / "nvme"), "--ram-bytes", str(RAM_TIER), "--shard-bytes", str(SHARD_NUMEL * 4),
        )  # fmt: skip
        try:
            client = ShardedClient([daemon.address], config=config)
            spec = ps_pb2.ModelSpec(model="scale", optimizer=ps_pb2.OptimizerSpec(), shard_bytes=SHARD_NUMEL * 4)
            spec.optimizer.adamw.CopyFrom(
                ps_pb2.AdamWSpec(lr=ADAMW.lr, beta1=ADAMW.beta1, beta2=ADAMW.beta2, eps=ADAMW.eps,
                                 weight_decay=ADAMW.weight_decay)
            )  # fmt: skip
            for i in range(shards):
                spec.params.add(name=f"layer{i}.weight", shape=[8192, SHARD_NUMEL // 8192], dtype=ps_pb2.FLOAT32)
            started = time.perf_counter()
            layout = client.register(spec)
            print(f"registered in {time.perf_counter() - started:.1f}s")
            out_buffers = threading.local()

            def out() -> memoryview:
                if not hasattr(out_buffers, "view"):
                    out_buffers.tensor = torch.empty(SHARD_NUMEL)
                    out_buffers.view = memoryview(out_buffers.tensor.numpy()).cast("B")
                return out_buffers.view

            pool = ThreadPoolExecutor(max_workers=2)

            def initial(shard) -> None:
                client.push(shard, step=0, kind=ps_pb2.PARAMETERS, data=init_bytes[: shard.numel * 4], lr=None)

            def step_of(step: int):
                def one(shard) -> None:
                    client.push(shard, step=step, kind=ps_pb2.GRADIENT, data=grad_bytes[: shard.numel * 4], lr=None)
                    client.pull(shard, min_version=step + 1, out=out()[: shard.numel * 4])

                return one

            started = time.perf_counter()
            list(pool.map(initial, layout))
            print(f"initial values written in {time.perf_counter() - started:.1f}s")
            fio_dir = root / "fio"
            fio_dir.mkdir()
            fio_path = fio_dir / "fio.dat"
            fio_seconds(fio_path, "write", io_bytes=FIO_BYTES, file_bytes=FIO_BYTES)  # lay the file out first
            fio_gbps: list[float] = []

            def fio() -> None:
                # The read share of the steps so far (the first pair runs ours first, so it is known).
                percent = round(100 * median(read_share))
                seconds = fio_seconds(fio_path, "rw", io_bytes=FIO_BYTES, file_bytes=FIO_BYTES, read_percent=percent)
                fio_gbps.append(FIO_BYTES / seconds / 1e9)
                print(f"fio: {fio_gbps[-1]:.2f} GB/s ({percent}% reads)")

            times, moved, read_share = [], [], []
            for step in range(args.steps):
                if step % 2 == 1:  # ABBA: fio first in odd pairs
                    fio()
                before = daemon_stats(daemon.address)
                started = time.perf_counter()
                list(pool.map(step_of(step), layout))
                times.append(time.perf_counter() - started)
                after = daemon_stats(daemon.address)
                read = after.nvme_bytes_read - before.nvme_bytes_read
                written = after.nvme_bytes_written - before.nvme_bytes_written
                moved.append(read + written)
                read_share.append(read / (read + written))
                print(
                    f"step {step}: {times[-1]:.1f}s, {read / 1e9:.1f} GB read + {written / 1e9:.1f} GB written, "
                    f"{(read + written) / times[-1] / 1e9:.2f} GB/s"
                )
                if step % 2 == 0:
                    fio()
            # The first shard against torch in this process: same values, same updates.
            first = torch.empty(SHARD_NUMEL)
            client.pull(layout[0], min_version=args.steps, out=memoryview(first.numpy()).cast("B"))
            exact = torch.equal(first, _reference(init, grad, args.steps))
            stats = daemon_stats(daemon.address)
            peak_rss = _peak_rss(daemon.process.pid)
            pool.shutdown()
            client.close()
        finally:
            daemon.stop(timeout=600)
        print(f"shard 0 equals torch fused AdamW: {exact}; daemon peak RSS {peak_rss / 2**30:.2f} GiB")
        if not exact:
            raise SystemExit("bench-scale: shard 0 differs from torch's AdamW on the same values")

        read_percent = round(100 * median(read_share))

    step_time = median(times)
    ours_gbps = [b / t / 1e9 for b, t in zip(moved, times, strict=True)]
    ratios = [o / p for o, p in zip(ours_gbps, fio_gbps, strict=True)]
    return record(
        "scale_train_step",
        ours=median(ours_gbps),
        peer=median(fio_gbps),
        ratio=median(ratios),
        unit="GB/s moved",
        target=0.8,
        higher_is_better=True,
        notes=(
            f"{n_params / 1e9:.2f}B params, {state / 1e9:.1f} GB AdamW state = {state / _meminfo('MemTotal'):.2f}x "
            f"physical RAM, RAM tier {RAM_TIER >> 30} GiB, {shards} shards of {SHARD_NUMEL * 4 >> 20} MiB; "
            f"synthetic gradients streamed by shard, 2 in flight; {args.steps} steps; peer: fio sequential "
            f"O_DIRECT, libaio iodepth 8, bs 8M, with the same read/write mix ({read_percent}% reads), "
            f"{FIO_BYTES >> 30} GiB per run, one run paired with each step in ABBA order; ratio = median of the "
            "per-pair ratios"
        ),
        extra={
            "step_seconds": round(step_time, 1),
            "ratio_spread": spread(ratios),
            "paired_gbps": [[round(o, 3), round(p, 3)] for o, p in zip(ours_gbps, fio_gbps, strict=True)],
            "state_bytes": state,
            "physical_ram_bytes": _meminfo("MemTotal"),
            "daemon_peak_rss_bytes": peak_rss,
            "bytes_moved_per_step": median(moved),
            "shard0_equals_torch": exact,
            "tier_hits": stats.tier_hits,
            "tier_misses": stats.tier_misses,
        },
    )


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
