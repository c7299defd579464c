"""zero_infinity_small, zero_infinity_large: the system this project exists to beat, on the
same machine. A GPT trained from NVMe by our streamed trainer (trainer/stream/optimizer.py) on a
ps-daemon whose RAM tier is a quarter of the AdamW state, against DeepSpeed ZeRO-Infinity
(ZeRO stage 3, `offload_param` and `offload_optimizer` on NVMe): the same TinyGPT (pre-norm
blocks, tied embeddings, fp32), the same initial values, batches, number of steps and AdamW
(no weight decay on biases and norms), no clipping, no accumulation, at two sizes, one whose
state fits in RAM and one whose state is four times the RAM our daemon is given.

Each trainer runs in a process of its own (bench/zero_infinity_worker.py: DeepSpeed's global
state and threads, the daemon's client, nothing shared), both alive throughout, each with the
same torch thread count (every core) and OMP_NUM_THREADS. After warm-up steps, they train in
alternating blocks of steps, ABBA (the first of a pair alternates), each block ending with
what its steps left in flight waited for. Ratio = DeepSpeed's step time over ours in each
pair of blocks (our step rate over theirs, higher is better), median over the pairs, target
>= 1.5 (issue 25). At the small size a fourth process in the same rounds trains ours on a daemon
with `store.fsync = false` (`durable_over_unsynced`): DeepSpeed's swapped state is never synced,
so this says what our durability at every acknowledgement costs against it. The first step's
losses of the two must agree (the same model, values and batch), and are in the result file
with the step times, peak RSS and bytes on disk of each side.

    python -m bench.zero_infinity             # both sizes (PS_BENCH_QUICK=1: tiny ones)
    python -m bench.zero_infinity small       # one of them
    python -m bench.zero_infinity --largest   # the largest model each trains here (long)

`--largest` (not in `make bench`) probes each system alone at doubling depths of a wider GPT
(then bisects between the last that trained and the first that did not), one step each at
batch 1, and records the largest that trained (`zero_infinity_largest`): a probe fails when
the process exits, passes the memory cap (the worker and its daemon together, checked every
second) or its time limit, or when its estimated disk use does not fit; see `largest()`.

DeepSpeed's configuration (`deepspeed_config` in the worker): `stage3_max_reuse_distance: 0`,
everything else DeepSpeed's documented defaults for ZeRO-Infinity (offload_param: 5 buffers
of 1e8 elements, max_in_cpu 1e9, so its fp32 parameters of these sizes stay in RAM and only
its optimizer state is swapped each step; offload_optimizer: 4 buffers; sub_group_size 1e9)
with the async I/O settings nvme_io measured DeepSpeed fastest with (1 MiB blocks, queue
depth 32). The `--largest` probe runs it lean instead (max_in_cpu 0, parameter buffers of the largest
parameter, sub_group_size 1e8), the settings that let it go furthest in memory.

DeepSpeed 0.19.8 on this CPU-only machine: what it took.
* Launcher environment, one process: DS_ACCELERATOR=cpu, MASTER_ADDR/PORT, RANK=0,
  WORLD_SIZE=1, LOCAL_RANK=0, `deepspeed.init_distributed(dist_backend="gloo")`. The first
  init_distributed compiles DeepSpeed's shared-memory comm op (about a minute, cached in
  torch's extension cache after).
* fp32 turned into bf16: `deepspeed.zero.Init(dtype=torch.float32)` partitions the model in
  bfloat16 (its swap folder is `bfloat16params`, the losses come out in bf16 steps). In
  `Init._set_dtype`, `dtype or torch.float16 if is_fp16_supported() else torch.bfloat16 if
  is_bf16_supported else torch.float32` parses as `(dtype or fp16) if fp16 else (bf16 if
  <bound method, always true> else fp32)`, so on a CPU whose oneDNN has no fp16 (this AMD
  EPYC, AVX-512 with bf16 but not fp16) any dtype passed becomes bfloat16. Fix: build the model
  inside `deepspeed.zero.Init(config_dict_or_path=config)` with no dtype; it then takes fp32
  from the config (neither bf16 nor fp16 enabled).
* "Not enough buffers 0 for swapping" at the first step with NVMe parameter offload
  (DeepSpeed issue #3062, met when this issue was written): the parameter swapper's buffers
  are all held by parameters kept for reuse; `"stage3_max_reuse_distance": 0` releases each
  after use. Not reproduced here without it (2 blocks of n_embd 256, 2 steps, with DeepSpeed's
  defaults and with --largest's lean settings); kept as the issue's workaround. With the
  defaults the parameters stay in RAM, so releasing them costs no I/O.
* Memory: DeepSpeed's default parameter buffers (5 of 1e8 elements, 2 GB in fp32) are
  allocated whatever the model's size, so its peak RSS starts above 2 GB; the full fp32
  gradient stays in RAM (`grad_partitions_flat_buffer`) in every setting.
* TinyGPT's init runs inside Init on parameters already partitioned (empty), so it sets
  nothing: the worker sets every module's values under `zero.GatheredParameters`, from the
  same per-parameter seeded draw our side uses (`initial_value`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from bench.common import REPO, DiskTicks, median, quick, record, spread
from bench.nvme_io import deepspeed_missing
from ps_offload.trainer.debug_models import GPTConfig, TinyGPT

ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
AIO = {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}  # fmt: skip
STATE_BYTES_PER_PARAM = 12  # AdamW: fp32 master, m and v
CONTENDERS = ("ours", "deepspeed")
# Interleaved with them, not a contender: forward and backward alone in RAM (the bound).
SYSTEMS = (*CONTENDERS, "compute")
# Where a size asks for it, ours not durable across a power cut, as DeepSpeed's state is not.
UNSYNCED = "ours_unsynced"


@dataclass(frozen=True)
class Size:
    gpt: GPTConfig
    shard_bytes: int
    """Our shards (a block is a whole number of them)."""
    steps_per_block: int
    pairs: int
    warmup: int = 2
    ram_fraction: float = 0.25
    """Our daemon's RAM tier, as a fraction of the AdamW state."""
    unsynced: bool = False
    """Also ours with store.fsync = false in the same rounds (what durability costs ours)."""


SIZES = {
    # ~21M parameters (the figure), 0.25 GB of AdamW state.
    "small": Size(
        GPTConfig(vocab_size=quick(4096, 256), block_size=64, n_layer=quick(6, 2), n_head=8, n_embd=quick(512, 64)),
        shard_bytes=quick(4 << 20, 64 << 10), steps_per_block=quick(4, 2), pairs=quick(6, 2), unsynced=True,
    ),
    # ~206M parameters, 2.5 GB of AdamW state.
    "large": Size(
        GPTConfig(vocab_size=quick(4096, 256), block_size=64, n_layer=quick(16, 4), n_head=16, n_embd=quick(1024, 128)),
        shard_bytes=quick(16 << 20, 256 << 10), steps_per_block=quick(2, 2), pairs=quick(4, 2),
    ),
}  # fmt: skip
BATCH = 8
THREADS = os.cpu_count() or 1


def n_params(gpt: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyGPT(gpt).parameters())  # the tied head counted once


def largest_param(gpt: GPTConfig) -> int:
    with torch.device("meta"):
        return max(p.numel() for p in TinyGPT(gpt).parameters())


def run_spec(gpt: GPTConfig, nvme_dir: Path, *, batch: int, ram_bytes: int, shard_bytes: int, lean: bool) -> dict:
    """What a worker builds (bench/zero_infinity_worker.py reads it). `lean`: DeepSpeed's
    parameters all on NVMe (max_in_cpu 0) through buffers as large as the largest parameter
    (not 1e8 elements), its optimizer state swapped in sub-groups of 1e8 (not 1e9)."""
    deepspeed = {"aio": AIO}
    if lean:
        deepspeed["offload_param"] = {"max_in_cpu": 0, "buffer_size": largest_param(gpt)}
        deepspeed["zero"] = {"sub_group_size": int(1e8)}
    return {
        "gpt": asdict(gpt), "batch": batch, "threads": THREADS, "adamw": ADAMW, "nvme_dir": str(nvme_dir),
        "ours": {"ram_bytes": ram_bytes, "shard_bytes": shard_bytes, "window_blocks": 2},
        "deepspeed": deepspeed,
    }  # fmt: skip


class Worker:
    """A worker process; `ask` sends a command and returns its JSON answer."""

    def __init__(self, system: str, spec: dict, log_path: Path) -> None:
        self.system, self.log_path = system, log_path
        read_fd, write_fd = os.pipe()
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), PYTHONUNBUFFERED="1")
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench.zero_infinity_worker", system, "--spec", json.dumps(spec),
                 "--reply-fd", str(write_fd)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_fd,), cwd=REPO,
                env=env, text=True,
            )  # fmt: skip
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.peak_tree_rss = 0

    def ask(self, command: str | None, *, timeout: float = 3600, rss_cap: int = 0) -> dict:
        """Sends `command` (None: waits for the start-up answer). With `rss_cap`, kills the
        worker once it and its children hold more than that (checked every second)."""
        if command is not None:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            answered = select.select([self.replies], [], [], 1.0)[0]
            self.peak_tree_rss = max(self.peak_tree_rss, tree_rss(self.process.pid))
            if rss_cap and self.peak_tree_rss > rss_cap:
                self.kill()
                raise WorkerFailed(f"memory cap: {self.peak_tree_rss / 2**30:.2f} GiB > {rss_cap / 2**30:.2f} GiB")
            if answered:
                break
            if time.monotonic() > deadline:
                self.kill()
                raise WorkerFailed(f"no answer to {command!r} in {timeout:.0f} s")
        line = self.replies.readline()
        if not line:
            code = self.process.wait()
            raise WorkerFailed(f"{self.system} worker exited with {code}: {self.log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            self.process.wait(timeout=60)
            raise WorkerFailed(f"{self.system} worker: {answer['error']}: {self.log_tail()}")
        return answer

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.ask("quit", timeout=300)
            except WorkerFailed:
                pass
        self.kill()
        self.replies.close()

    def kill(self) -> None:
        """Kills the worker and its children (our daemon)."""
        if self.process.poll() is None:
            for pid in [*_children(self.process.pid), self.process.pid]:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        self.process.wait()


class WorkerFailed(RuntimeError):
    pass


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *_children(kid)]
    return out


def tree_rss(pid: int) -> int:
    """The peak resident bytes (VmHWM) of `pid` and of its descendants, summed: at least the
    tree's peak, and a peak shorter than the polling interval still counts."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def compare(name: str, size: Size) -> dict:
    """One size: both workers alive, warm-up, then ABBA blocks of steps."""
    params = n_params(size.gpt)
    state = STATE_BYTES_PER_PARAM * params
    ram_bytes = int(size.ram_fraction * state)
    # The unsynced one beside ours in every round (ABCD DCBA), as ours is beside DeepSpeed.
    systems = (UNSYNCED, *SYSTEMS) if size.unsynced else SYSTEMS
    with tempfile.TemporaryDirectory(prefix="ps-bench-zi-", dir=REPO) as tmp:
        workers: dict[str, Worker] = {}
        try:
            init_seconds = {}
            for system in systems:  # one at a time: each init takes both cores
                nvme = Path(tmp) / system
                nvme.mkdir()
                spec = run_spec(size.gpt, nvme, batch=BATCH, ram_bytes=ram_bytes, shard_bytes=size.shard_bytes,
                                lean=False)  # fmt: skip
                workers[system] = Worker(system, spec, Path(tmp) / f"{system}.log")
                init_seconds[system] = workers[system].ask(None)["init_seconds"]
            warm = {system: w.ask(f"steps {size.warmup}")["losses"] for system, w in workers.items()}
            seconds: dict[str, list[float]] = {system: [] for system in systems}
            losses: dict[str, list[float]] = {system: [] for system in systems}
            usage: dict[str, collections.Counter] = {system: collections.Counter() for system in systems}
            disk = {system: DiskTicks(0, 0) for system in systems}  # the disk under tmp, in each one's blocks
            on_disk = DiskTicks.of(tmp) is not None
            for pair in range(size.pairs):
                for system in systems if pair % 2 == 0 else systems[::-1]:  # ABC CBA
                    before = DiskTicks.of(tmp) if on_disk else None
                    answer = workers[system].ask(f"steps {size.steps_per_block}")
                    if before is not None:
                        disk[system] += DiskTicks.of(tmp) - before
                    seconds[system].append(answer["seconds"] / size.steps_per_block)
                    losses[system] += answer["losses"]
                    usage[system].update(answer["usage"])
            stats = {system: w.ask("stats") for system, w in workers.items()}
        finally:
            for w in workers.values():
                w.close()
    ratios = [d / o for o, d in zip(seconds["ours"], seconds["deepspeed"], strict=True)]
    # What bounds the figure: DeepSpeed's step over forward and backward alone, the most any
    # offload system could gain on it here; and ours over that.
    bound = [d / c for c, d in zip(seconds["compute"], seconds["deepspeed"], strict=True)]
    ours_over_compute = [o / c for c, o in zip(seconds["compute"], seconds["ours"], strict=True)]
    ms = {system: round(1000 * median(s), 1) for system, s in seconds.items()}
    # The share of each one's time the disk under the bench had I/O in flight (io_ticks), and the
    # flushes it saw per step (our commits' fdatasyncs; DeepSpeed's writes sync nothing); None
    # where the bench's directory has no block device under it (tmpfs, overlay).
    steps = size.pairs * size.steps_per_block
    disk_busy = {s: round(disk[s].busy_ms / 1000 / sum(seconds[s]) / size.steps_per_block, 3) for s in systems}
    disk_flushes = {s: round(disk[s].flushes / steps, 2) for s in systems}
    if not on_disk:
        disk_busy = disk_flushes = None
    first = {system: round(w[0], 5) for system, w in warm.items()}
    if max(first.values()) - min(first.values()) > 1e-3 * abs(first["ours"]):
        raise RuntimeError(f"{name}: the first step's losses differ ({first}): not the same model, values or batch")
    g = size.gpt
    return record(
        name,
        ours=1000 / ms["ours"],
        peer=1000 / ms["deepspeed"],
        unit="steps/s",
        target=1.5,
        higher_is_better=True,
        ratio=median(ratios),
        notes=f"{params / 1e6:.1f}M-param TinyGPT ({g.n_layer} blocks, n_embd {g.n_embd}, vocab {g.vocab_size}), "
        f"fp32, batch {BATCH} x {g.block_size}, AdamW lr {ADAMW['lr']} wd {ADAMW['weight_decay']} (none on biases "
        f"and norms); ours: streamed, window 2 blocks, micro_batches=1, daemon RAM tier {ram_bytes >> 20} MiB "
        f"({size.ram_fraction:g} of the {state / 1e9:.2f} GB AdamW state), NVMe tier, shards of "
        f"{size.shard_bytes >> 10} KiB; DeepSpeed {_deepspeed_version()} ZeRO-3, offload_param and offload_optimizer "
        f"on NVMe (defaults but stage3_max_reuse_distance 0), DeepSpeedCPUAdam; each in its own process, "
        f"{THREADS} torch threads and OMP_NUM_THREADS={THREADS}; {size.warmup} warm-up steps, then {size.pairs} "
        f"pairs of {size.steps_per_block}-step blocks, ABC CBA with forward and backward alone in RAM (compute, the "
        "bound)"
        + (" and ours with store.fsync = false (not a contender: durability's cost)" if size.unsynced else "")
        + "; ratio: median of per-pair DeepSpeed/ours step times",
        extra={
            "ratio_spread": spread(ratios),
            "ms_per_step": ms,
            "bound_ratio": round(median(bound), 3),
            "bound_ratio_spread": spread(bound),
            "ours_over_compute": round(median(ours_over_compute), 3),
            **_durability(seconds),
            "params": params,
            "state_bytes": state,
            "ours_ram_tier_bytes": ram_bytes,
            "peak_rss_bytes": {system: stats[system]["peak_rss_bytes"] for system in CONTENDERS},
            "ours_peak_rss_split": {k: stats["ours"][k] for k in ("trainer_peak_rss_bytes", "daemon_peak_rss_bytes")},
            "nvme_bytes": {system: stats[system]["nvme_bytes"] for system in CONTENDERS},
            "ours_phase_ms": stats["ours"]["phase_ms"],
            "ours_freed_memory": stats["ours"]["freed_memory"],
            # Each system's own process (ours: the trainer, not its daemon), per step.
            "process_per_step": {system: _per_step(usage[system], steps) for system in systems},  # fmt: skip
            "ours_daemon_per_step": stats["ours"]["daemon_per_step"],
            "ours_waits_ms_per_step": stats["ours"]["waits_ms_per_step"],
            "disk_busy_share": disk_busy,
            "disk_flushes_per_step": disk_flushes,
            "ours_window": stats["ours"]["window"],
            "init_seconds": init_seconds,
            "first_loss": first,
            "last_loss": {system: round(losses[system][-1], 5) for system in CONTENDERS},
            "threads": THREADS,
        },
    )


def _durability(seconds: dict[str, list[float]]) -> dict:
    """Ours durable at every acknowledgement over ours with store.fsync = false, paired."""
    if UNSYNCED not in seconds:
        return {}
    paired = [o / u for o, u in zip(seconds["ours"], seconds[UNSYNCED], strict=True)]
    return {"durable_over_unsynced": round(median(paired), 3), "durable_over_unsynced_spread": spread(paired)}


def _per_step(usage: collections.Counter, steps: int) -> dict:
    ms = {f"{kind}_ms": round(1000 * usage[f"{kind}_s"] / steps, 1) for kind in ("user", "system")}
    return {**ms, "minor_faults": round(usage["minor_faults"] / steps)}


def _deepspeed_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("deepspeed")


def main(sizes: list[str] | None = None) -> list[dict]:
    missing = deepspeed_missing()
    if missing:
        print(f"zero_infinity: {missing}; nothing recorded")
        return []
    return [compare(f"zero_infinity_{name}", SIZES[name]) for name in sizes or SIZES]


# -- the largest model each trains ------------------------------------------------------------

PROBE_GPT = GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=16, n_embd=quick(2048, 128))
PROBE_SHARD_BYTES = 64 << 20


def disk_estimate(system: str, params: int) -> int:
    """Bytes on disk: ours, the AdamW state and the daemon's spare slots (8, at most one per
    shard) of a shard's arena (master, m, v); DeepSpeed, 20.5 bytes per parameter as measured here at 21M and 29M
    (fp32 parameters, master, m and v, and its padding)."""
    if system == "ours":
        shards = -(-4 * params // PROBE_SHARD_BYTES)
        return STATE_BYTES_PER_PARAM * params + min(8, shards) * 3 * PROBE_SHARD_BYTES
    return int(20.5 * params)


@dataclass
class Probe:
    system: str
    trained: dict[int, dict] = field(default_factory=dict)  # n_layer -> what the step took
    failed: dict[int, str] = field(default_factory=dict)  # n_layer -> why


def _meminfo(key: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _probe_one(system: str, n_layer: int, args, workdir: Path) -> dict:
    """One step of `system` at `n_layer` in a fresh worker; raises WorkerFailed."""
    gpt = replace(PROBE_GPT, n_layer=n_layer, n_embd=args.n_embd)
    params = n_params(gpt)
    need = disk_estimate(system, params)
    free = shutil.disk_usage(workdir).free - args.disk_reserve_gib * 2**30
    if need > free:
        raise WorkerFailed(f"disk: needs ~{need / 1e9:.1f} GB, {max(free, 0) / 1e9:.1f} GB free above the reserve")
    nvme = workdir / f"{system}-{n_layer}"
    nvme.mkdir()
    spec = run_spec(gpt, nvme, batch=1, ram_bytes=args.ram_gib * 2**30, shard_bytes=PROBE_SHARD_BYTES, lean=True)
    worker = Worker(system, spec, workdir / f"{system}-{n_layer}.log")
    try:
        cap = args.memory_cap_gib * 2**30
        init = worker.ask(None, timeout=args.probe_timeout, rss_cap=cap)["init_seconds"]
        step = worker.ask("steps 1", timeout=args.probe_timeout, rss_cap=cap)
        stats = worker.ask("stats", timeout=60)
        return {"params": params, "init_seconds": init, "step_seconds": round(step["seconds"], 2),
                "loss": step["losses"][0], "peak_rss_bytes": max(worker.peak_tree_rss, stats["peak_rss_bytes"]),
                "nvme_bytes": stats["nvme_bytes"]}  # fmt: skip
    finally:
        worker.close()
        shutil.rmtree(nvme, ignore_errors=True)


def _probe(system: str, args, workdir: Path) -> Probe:
    """Doubling n_layer from args.start until a failure or args.max_layers, then bisecting
    between the last that trained and the first that failed, args.refine times at most."""
    probe = Probe(system)

    def attempt(n_layer: int) -> bool:
        params = n_params(replace(PROBE_GPT, n_layer=n_layer, n_embd=args.n_embd))
        print(f"  {system}: n_layer {n_layer} ({params / 1e6:.0f}M params) ...", flush=True)
        try:
            probe.trained[n_layer] = _probe_one(system, n_layer, args, workdir)
        except WorkerFailed as exc:
            probe.failed[n_layer] = str(exc).splitlines()[0][:300]
            print(f"    failed: {probe.failed[n_layer]}", flush=True)
            return False
        print(f"    trained: step {probe.trained[n_layer]['step_seconds']} s", flush=True)
        return True

    n = args.start
    while n <= args.max_layers and attempt(n):
        n *= 2
    low, high = (max(probe.trained, default=0), min(probe.failed, default=0))
    for _ in range(args.refine):
        if not high or high - low <= 1:
            break
        mid = (low + high) // 2 if low else max(1, high // 2)
        if attempt(mid):
            low = mid
        else:
            high = mid
    return probe


def largest(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.zero_infinity --largest")
    parser.add_argument("--n-embd", type=int, default=PROBE_GPT.n_embd)
    parser.add_argument("--start", type=int, default=quick(4, 1), help="first n_layer")
    parser.add_argument("--max-layers", type=int, default=quick(1024, 4), help="stop doubling past this n_layer")
    parser.add_argument("--refine", type=int, default=2, help="bisection probes after the first failure")
    parser.add_argument("--ram-gib", type=int, default=4, help="our daemon's RAM tier")
    parser.add_argument(
        "--memory-cap-gib",
        type=float,
        default=None,
        help="a worker with its children past this is stopped (default: 90%% of MemAvailable now)",
    )
    parser.add_argument("--disk-reserve-gib", type=int, default=10, help="disk left free")
    parser.add_argument("--probe-timeout", type=float, default=3600, help="seconds for a probe's start and its step")
    args = parser.parse_args(argv)  # fmt: skip
    if args.memory_cap_gib is None:
        args.memory_cap_gib = round(0.9 * _meminfo("MemAvailable") / 2**30, 1)
    missing = deepspeed_missing()
    if missing:
        raise SystemExit(f"zero_infinity --largest: {missing}")
    print(f"zero_infinity --largest: n_embd {args.n_embd}, memory cap {args.memory_cap_gib} GiB, our RAM tier "
          f"{args.ram_gib} GiB, disk reserve {args.disk_reserve_gib} GiB")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ps-bench-zi-largest-", dir=REPO) as tmp:
        probes = {system: _probe(system, args, Path(tmp)) for system in ("ours", "deepspeed")}
    best = {system: max(p.trained, default=0) for system, p in probes.items()}
    if not all(best.values()):
        failed = {system: p.failed for system, p in probes.items()}
        raise SystemExit(f"zero_infinity --largest: a system trained none of the sizes ({failed}); lower --start")
    params = {system: p.trained[best[system]]["params"] for system, p in probes.items()}
    return record(
        "zero_infinity_largest",
        ours=params["ours"] / 1e6,
        peer=params["deepspeed"] / 1e6,
        unit="M params",
        target=1.0,
        higher_is_better=True,
        ratio=params["ours"] / params["deepspeed"],
        notes=f"TinyGPT n_embd {args.n_embd}, fp32, batch 1 x {PROBE_GPT.block_size}, one step per probe in a fresh "
        f"process; n_layer doubled from {args.start} (to {args.max_layers} at most), then {args.refine} bisections; "
        f"memory cap {args.memory_cap_gib} GiB (worker + its daemon), disk reserve {args.disk_reserve_gib} GiB; "
        f"ours: daemon RAM tier {args.ram_gib} GiB, 64 MiB shards; DeepSpeed lean: max_in_cpu 0, parameter buffers "
        "of the largest parameter, sub_group_size 1e8",
        extra={
            "largest_n_layer": best,
            "probes": {s: {"trained": p.trained, "failed": p.failed} for s, p in probes.items()},
            "memory_cap_gib": args.memory_cap_gib,
            "n_embd": args.n_embd,
        },
    )


if __name__ == "__main__":
    if "--largest" in sys.argv[1:]:
        largest([a for a in sys.argv[1:] if a != "--largest"])
    else:
        unknown = set(sys.argv[1:]) - set(SIZES)
        if unknown:
            raise SystemExit(f"zero_infinity: unknown sizes {sorted(unknown)}; the sizes are {list(SIZES)}")
        main(sys.argv[1:])
