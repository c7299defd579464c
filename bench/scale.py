"""`make bench-scale`: a GPT whose AdamW state is twice this machine's physical RAM, trained
end to end through one daemon with an NVMe tier and a RAM tier of 4 GiB; reports the step
time against the disk bound of a step, measured with fio on the same disk in the same run.

The model is a byte-level GPT of blocks of n_embd 2560 (78.7M parameters each), as many as
make 12 bytes of AdamW state per parameter (fp32 master, exp_avg, exp_avg_sq) at least
`--ram-multiple` x MemTotal: 54 blocks, 4.25B parameters, for 2x on a 23.5 GiB machine. Its
context is 64 tokens of batch 1, so that a step's compute stays small beside its disk I/O.
The trainer (bench/scale_worker.py) runs in a process of its own, so that its peak RSS is
its own: it builds the model on the meta device and streams it (trainer/stream/optimizer.py), each
block initialised and pushed in turn at creation (the state's initial write), then pulled
before its forward and again before its backward, a window of two blocks on the trainer at
most; with `micro_batches=1` the daemon applies each block's gradient as it arrives during
backward. Each block is 5 shards of equal size. Loss is printed per step (the same batch
each step, so it falls).

The disk bound of a step: the bytes it must move, the AdamW state read once and written once
(24 bytes per parameter; the least that one update of state living on disk can move), over
the disk's bandwidth for that half-read, half-write mix, as fio (sequential O_DIRECT, libaio)
measures it next to the step. Each step is paired with an fio run, in ABBA order (step then
fio, fio then step, ...): this disk's speed drifts by tens of percent within minutes. The
figure is the median of the per-pair ratios bound / step time (`ours` is the state's 24
bytes per parameter over the step time, `peer` fio's GB/s), target >= 0.8. The bytes the
daemon actually read and wrote per step, the trainer's and the daemon's peak RSS (the
trainer's target: <= 3 GiB), the losses and the creation time are in the result file. fio
moves 4 GiB in a 4 GiB file per run, not a step's 100 GB: a file of the arena's size would
need twice the disk this machine has.

It checks free disk and memory first and says what it needs. A run below 2x RAM, or under
PS_BENCH_QUICK=1, checks that the script works: its RAM tier is an eighth of its state (at
least what a step keeps in use at once), its fio runs are smaller, and its result goes to
bench/results/quick/; `--smoke` runs two narrow blocks and records nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import QUICK, REPO, daemon_stats, median, record, spread
from bench.nvme_io import fio_seconds
from bench.scale_worker import WINDOW_BLOCKS, gpt_config
from ps_offload.daemon.config import StoreConfig
from ps_offload.daemon.local import LocalDaemon
from ps_offload.daemon.store.shard import arena_nbytes
from ps_offload.daemon.tiers.nvme import FileLayout
from ps_offload.optimizers import AdamW
from ps_offload.proto.plan import (
    FP32_BYTES,
    SHARD_ALIGN_BYTES,
    layout_params,
    plan_shards,
    shard_numel_for,
    shard_starts,
)
from ps_offload.trainer.debug_models import TinyGPT

N_EMBD = 2560
SMOKE_EMBD = 128
BLOCK_SIZE = 64
SHARDS_PER_BLOCK = 5
STATE_PER_PARAM = 12  # fp32 master, exp_avg, exp_avg_sq
MUST_MOVE_PER_PARAM = 2 * STATE_PER_PARAM  # the state read once and written once
RAM_TIER = 4 << 30
# A scaled-down tier still holds what a step keeps in use at once: the shards of the blocks
# the trainer holds and of the one it pushes, and the daemon's read-ahead. (Smaller, each
# block's push finds its shards evicted by the pulls of the blocks after it, and reads them again.)
MIN_TIER_ARENAS = (WINDOW_BLOCKS + 1) * SHARDS_PER_BLOCK + StoreConfig().prefetch_depth + 1
FULL_RAM_MULTIPLE = 2.0  # the size; below it, a run only checks the script
MARGIN = 2 << 30
DAEMON_MEMORY = 2 << 30  # the daemon's own, beside its RAM tier: torch, scratch buffers
TRAINER_TARGET = 3 << 30
STREAMS = 2  # concurrent pushes and pulls between the trainer and the daemon


@dataclass(frozen=True)
class Plan:
    """What a run of `--ram-multiple` trains, and what it needs."""

    n_layer: int
    n_embd: int
    params: int
    shard_bytes: int
    shards: int
    state_bytes: int
    """12 bytes per parameter."""
    arena_bytes: int
    """The daemon's arena file for the model (slots of the largest shard's state, plus spares)."""
    ram_tier_bytes: int
    fio_bytes: int
    disk_bytes: int
    """arena_bytes + fio's file + a margin."""
    memory_bytes: int
    """The RAM tier, the daemon's own memory and the trainer's target."""
    full: bool
    """At the issue's size (and not PS_BENCH_QUICK): the run's result is the real one."""


def meminfo(key: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def block_params(n_embd: int) -> int:
    """A block's parameters: attention's qkv and projection, the MLP (4x), their biases and
    two LayerNorms."""
    return 12 * n_embd * n_embd + 13 * n_embd


def _shard_plan(n_layer: int, n_embd: int) -> tuple[int, int, int, int]:
    """(parameters, shard_bytes, shards, the largest shard's elements) of the streamed GPT, as
    the trainer cuts it: a shard starts at each unit (a block, or a run of parameters outside
    the blocks), and shard_bytes makes each block SHARDS_PER_BLOCK shards of equal size. The
    plan of a one-block model, with its block repeated: every block is cut alike."""
    with torch.device("meta"):
        model = TinyGPT(gpt_config(n_layer=1, n_embd=n_embd, block_size=BLOCK_SIZE))
    named = list(model.named_parameters())
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    page = SHARD_ALIGN_BYTES // FP32_BYTES  # a shard is whole pages of fp32
    shard_bytes = -(-block_numel // (SHARDS_PER_BLOCK * page)) * page * FP32_BYTES
    # The unit of a parameter: its block's index, or None outside the blocks.
    unit = [int(n.split(".")[1]) if n.startswith("blocks.") else None for n, _ in named]
    starts_shard = [i > 0 and unit[i] != unit[i - 1] for i in range(len(named))]
    layouts = layout_params([(n, tuple(p.shape), None) for n, p in named])
    total = sum(p.numel() for _, p in named)
    shards = plan_shards(total, shard_numel_for(shard_bytes), 1, shard_starts(layouts, starts_shard))
    block_start = layouts[unit.index(0)].offset
    per_block = sum(block_start <= s.offset < block_start + block_numel for s in shards)
    extra = n_layer - 1
    return total + extra * block_numel, shard_bytes, len(shards) + extra * per_block, max(s.numel for s in shards)


def plan(ram_multiple: float, *, n_embd: int = N_EMBD, mem_total: int | None = None) -> Plan:
    """The GPT whose AdamW state is at least `ram_multiple` x physical RAM (`mem_total`,
    default MemTotal), in blocks of `n_embd`, and what training it needs."""
    mem_total = meminfo("MemTotal") if mem_total is None else mem_total
    needed = ram_multiple * mem_total / STATE_PER_PARAM
    n_layer = max(1, -(-int(needed) // block_params(n_embd)))
    params, shard_bytes, shards, largest = _shard_plan(n_layer, n_embd)
    while params * STATE_PER_PARAM < ram_multiple * mem_total:  # the embeddings did not make up a block
        n_layer += 1
        params, shard_bytes, shards, largest = _shard_plan(n_layer, n_embd)
    arenas = dict.fromkeys(range(shards), arena_nbytes(largest, AdamW()))  # slots: the largest's
    layout = FileLayout.for_shards(arenas, spare_slots=StoreConfig().nvme_spare_slots)
    state = params * STATE_PER_PARAM
    full = ram_multiple >= FULL_RAM_MULTIPLE and n_embd == N_EMBD and not QUICK
    # Scaled down with the model (an eighth of its state) below 4 GiB, so that a small run evicts too.
    ram_tier = min(RAM_TIER, max(MIN_TIER_ARENAS * layout.slot_bytes, state // 8))
    fio_bytes = 4 << 30 if full else 256 << 20
    return Plan(
        n_layer=n_layer, n_embd=n_embd, params=params, shard_bytes=shard_bytes, shards=shards,
        state_bytes=state, arena_bytes=layout.size, ram_tier_bytes=ram_tier, fio_bytes=fio_bytes,
        disk_bytes=layout.size + fio_bytes + MARGIN, memory_bytes=ram_tier + DAEMON_MEMORY + TRAINER_TARGET,
        full=full,
    )  # fmt: skip


def check_room(workdir: Path, p: Plan) -> None:
    """Exits saying what is missing when the disk under `workdir` or the available memory
    is too small for the plan."""
    free = shutil.disk_usage(workdir).free
    if free < p.disk_bytes:
        raise SystemExit(
            f"bench-scale: needs {p.disk_bytes / 1e9:.1f} GB free under {workdir} (the model's arena file "
            f"{p.arena_bytes / 1e9:.1f} GB, fio's probe file {p.fio_bytes / 1e9:.1f} GB and a margin of "
            f"{MARGIN / 1e9:.1f} GB); {free / 1e9:.1f} GB are free. Free space, or pass a smaller --ram-multiple "
            "(the issue asks for 2)"
        )
    available = meminfo("MemAvailable")
    if available < p.memory_bytes:
        raise SystemExit(
            f"bench-scale: needs {p.memory_bytes / 2**30:.1f} GiB of available memory (the daemon's RAM tier "
            f"{p.ram_tier_bytes / 2**30:.1f} GiB and {DAEMON_MEMORY / 2**30:.1f} GiB of its own, the trainer's "
            f"{TRAINER_TARGET >> 30} GiB); {available / 2**30:.1f} GiB are available"
        )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def describe(p: Plan) -> str:
    mem_total = meminfo("MemTotal")
    return (
        f"bench-scale: {_count(p.params)} parameters ({p.n_layer} blocks of n_embd {p.n_embd}), "
        f"{p.state_bytes / 1e9:.1f} GB of AdamW state ({p.state_bytes / mem_total:.2f}x this machine's "
        f"{mem_total / 2**30:.1f} GiB of RAM), {p.shards} shards of at most {p.shard_bytes / 2**20:.3g} MiB, "
        f"RAM tier {p.ram_tier_bytes / 2**30:.1f} GiB; needs {p.disk_bytes / 1e9:.1f} GB of disk and "
        f"{p.memory_bytes / 2**30:.1f} GiB of memory"
    )


class Worker:
    """bench/scale_worker.py as a child process, one step per request."""

    def __init__(self, p: Plan, address: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.scale_worker", "--daemon", address, "--n-layer", str(p.n_layer),
             "--n-embd", str(p.n_embd), "--block-size", str(BLOCK_SIZE), "--shard-bytes", str(p.shard_bytes),
             "--streams", str(STREAMS)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def expect(self, event: str) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"bench-scale: the trainer exited with {self.process.wait()} (its stderr is above)")
        message = json.loads(line)
        if message["event"] != event:
            raise RuntimeError(f"the trainer said {message}, expected {event!r}")
        return message

    def step(self) -> dict:
        self.process.stdin.write("step\n")
        self.process.stdin.flush()
        return self.expect("step")

    def close(self) -> dict:
        self.process.stdin.write("close\n")
        self.process.stdin.close()
        closed = self.expect("closed")
        if self.process.wait(timeout=600):
            raise SystemExit(f"bench-scale: the trainer exited with {self.process.returncode}")
        return closed

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _delta(after, before, *fields: str) -> dict[str, float]:
    return {f: getattr(after, f) - getattr(before, f) for f in fields}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ram-multiple", type=float, default=FULL_RAM_MULTIPLE, help="state size over physical RAM")
    parser.add_argument("--steps", type=int, default=3, help="training steps, each paired with an fio run")
    parser.add_argument("--n-embd", type=int, default=N_EMBD, help="block width (smaller: a quicker check)")
    parser.add_argument("--check-only", action="store_true", help="print what it needs and exit")
    parser.add_argument("--smoke", action="store_true", help="two steps of two narrow blocks; nothing recorded")
    args = parser.parse_args()

    if args.smoke:
        args.n_embd, args.steps = SMOKE_EMBD, 2
        args.ram_multiple = 2 * block_params(SMOKE_EMBD) * STATE_PER_PARAM / meminfo("MemTotal")  # two blocks
    p = plan(args.ram_multiple, n_embd=args.n_embd)
    print(describe(p))
    check_room(REPO, p)
    if args.check_only:
        return {}
    if not p.full and not args.smoke:
        print("bench-scale: below the issue's size (or PS_BENCH_QUICK): the result goes to bench/results/quick/")

    with tempfile.TemporaryDirectory(prefix="ps-bench-scale-", dir=REPO) as tmp:
        root = Path(tmp)
        fio_path = root / "fio.dat"
        fio_seconds(fio_path, "write", io_bytes=p.fio_bytes, file_bytes=p.fio_bytes)  # lay the file out first
        # Room in the node's pool for the trainer's windows (its blocks' slots, gradient buffers
        # and staging), with a margin: a window the pool refuses sends its bytes through a copy.
        config = root / "daemon.toml"
        config.write_text(f"[server]\nlocal_pool_bytes = {2 * p.params + (1 << 30)}\n")
        daemon = LocalDaemon(
            root / "daemon", "--log-level", "WARNING", "--nvme-dir", str(root / "nvme"),
            "--ram-bytes", str(p.ram_tier_bytes), "--shard-bytes", str(p.shard_bytes), "--config", str(config),
        )  # fmt: skip
        worker = None
        try:
            start = daemon_stats(daemon.address)
            worker = Worker(p, daemon.address)
            ready = worker.expect("ready")
            created = daemon_stats(daemon.address)
            print(
                f"created and pushed in {ready['create_seconds']:.1f}s "
                f"({(created.nvme_bytes_written - start.nvme_bytes_written) / 1e9:.1f} GB written)"
            )
            fio_gbps: list[float] = []

            def fio() -> None:
                seconds = fio_seconds(
                    fio_path, "rw", io_bytes=p.fio_bytes, file_bytes=p.fio_bytes, read_percent=50
                )  # the mix of the bytes a step must move
                fio_gbps.append(p.fio_bytes / seconds / 1e9)
                print(f"fio: {fio_gbps[-1]:.2f} GB/s (50% reads)")

            steps, moved = [], []
            counters = (
                "nvme_bytes_read", "nvme_bytes_written", "tier_hits", "tier_misses", "evictions", "prefetched",
                "optimizer_seconds", "nvme_read_seconds", "nvme_write_seconds",
            )  # fmt: skip
            for step in range(args.steps):
                if step % 2 == 1:  # ABBA: fio first in odd pairs
                    fio()
                before = daemon_stats(daemon.address)
                steps.append(worker.step())
                moved.append(_delta(daemon_stats(daemon.address), before, *counters))
                s, m = steps[-1], moved[-1]
                print(
                    f"step {step}: loss {s['loss']:.4f}, {s['seconds']:.1f}s (forward {s['forward_seconds']:.1f}, "
                    f"backward {s['backward_seconds']:.1f}, step {s['step_seconds']:.1f}); "
                    f"{m['nvme_bytes_read'] / 1e9:.2f} GB read + {m['nvme_bytes_written'] / 1e9:.2f} GB written "
                    f"({(m['nvme_bytes_read'] + m['nvme_bytes_written']) / p.params:.1f} B/param), "
                    f"tier {m['tier_hits']} hits / {m['tier_misses']} misses, {m['prefetched']} prefetched, "
                    f"{m['evictions']} evicted"
                )
                if step % 2 == 0:
                    fio()
            closed = worker.close()
            daemon_rss = peak_rss(daemon.process.pid)
        finally:
            if worker is not None:
                worker.kill()
            daemon.stop(timeout=600)

    trainer_rss = max(closed["peak_rss_bytes"], *(s["peak_rss_bytes"] for s in steps), ready["peak_rss_bytes"])
    must_move = MUST_MOVE_PER_PARAM * p.params
    times = [s["seconds"] for s in steps]
    bounds = [must_move / (g * 1e9) for g in fio_gbps]
    ratios = [b / t for b, t in zip(bounds, times, strict=True)]
    actual = [m["nvme_bytes_read"] + m["nvme_bytes_written"] for m in moved]
    losses = ", ".join(f"{s['loss']:.4f}" for s in steps)
    print(
        f"trainer peak RSS {trainer_rss / 2**30:.2f} GiB (target <= {TRAINER_TARGET >> 30}), daemon peak RSS "
        f"{daemon_rss / 2**30:.2f} GiB; losses {losses}"
    )
    if args.smoke:
        print("bench-scale: smoke run, nothing recorded")
        return {"ratios": ratios, "losses": [s["loss"] for s in steps]}
    mem_total = meminfo("MemTotal")
    return record(
        "scale_train_step",
        ours=must_move / median(times) / 1e9,
        peer=median(fio_gbps),
        ratio=median(ratios),
        unit="GB/s",
        target=0.8,
        higher_is_better=True,
        notes=(
            f"{p.params / 1e9:.2f}B-parameter GPT ({p.n_layer} blocks, n_embd {p.n_embd}, {BLOCK_SIZE} tokens x 1, "
            f"bf16), {p.state_bytes / 1e9:.1f} GB AdamW state = {p.state_bytes / mem_total:.2f}x physical RAM, "
            f"streamed through one daemon with a {p.ram_tier_bytes / 2**30:.1f} GiB RAM tier over NVMe, "
            f"{p.shards} shards; {args.steps} steps. ours: the bytes a step must move (the state read once and "
            f"written once, {MUST_MOVE_PER_PARAM} B/param, the least one update of state on disk can move) over "
            "the step time (forward + backward + step); peer: fio sequential O_DIRECT, libaio iodepth 8, bs 8M, "
            f"50% reads, {p.fio_bytes >> 20} MiB per run, one run paired with each step in ABBA order; ratio = "
            "median of the per-pair ratios disk bound / step time"
        ),
        extra={
            "step_seconds": round(median(times), 1),
            "disk_bound_seconds": round(median(bounds), 1),
            "paired_seconds": [[round(t, 1), round(b, 1)] for t, b in zip(times, bounds, strict=True)],
            "ratio_spread": spread(ratios),
            "phase_seconds": {
                k: round(median([s[f"{k}_seconds"] for s in steps]), 1) for k in ("forward", "backward", "step")
            },
            "losses": [round(s["loss"], 4) for s in steps],
            "params": p.params,
            "n_layer": p.n_layer,
            "n_embd": p.n_embd,
            "shards": p.shards,
            "shard_bytes": p.shard_bytes,
            "state_bytes": p.state_bytes,
            "physical_ram_bytes": mem_total,
            "ram_tier_bytes": p.ram_tier_bytes,
            "arena_file_bytes": p.arena_bytes,
            "create_seconds": round(ready["create_seconds"], 1),
            "bytes_read_per_step": median([m["nvme_bytes_read"] for m in moved]),
            "bytes_written_per_step": median([m["nvme_bytes_written"] for m in moved]),
            "bytes_moved_per_param": round(median(actual) / p.params, 2),
            "moved_gbps": round(median([a / t / 1e9 for a, t in zip(actual, times, strict=True)]), 3),
            "trainer_peak_rss_bytes": trainer_rss,
            "trainer_rss_target_bytes": TRAINER_TARGET,
            "trainer_rss_target_met": trainer_rss <= TRAINER_TARGET,
            "daemon_peak_rss_bytes": daemon_rss,
            "tier_hits": sum(m["tier_hits"] for m in moved),
            "tier_misses": sum(m["tier_misses"] for m in moved),
            "tier_evictions": sum(m["evictions"] for m in moved),
            "block_pulls": closed["block_pulls"],
            # Summed over the daemon's threads (its I/O threads: 4 reading, 4 writing).
            "daemon_seconds_per_step": {
                k: round(median([m[f"{k}_seconds"] for m in moved]), 1)
                for k in ("optimizer", "nvme_read", "nvme_write")
            },
        },
        scaled_down=not p.full,
    )


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
