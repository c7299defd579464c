"""What every benchmark shares: timing, the result record, and starting a daemon.

Each script measures our figure and its peer in the same run, interleaved, and reports the
ratio: these machines are noisy, so absolute times mean little and the ratio is the figure.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2, ps_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
# PS_BENCH_QUICK=1: small sizes and few repetitions, to check that a script runs end to end.
# Its figures mean nothing, so they go to bench/results/quick/ (ignored by git), never into
# the results the doc's table is made from.
QUICK = os.environ.get("PS_BENCH_QUICK", "") not in ("", "0")
RESULTS = REPO / "bench" / "results" / ("quick" if QUICK else "")


def quick(full, small):
    """`small` under PS_BENCH_QUICK=1, else `full`."""
    return small if QUICK else full


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


def interleaved_many(fns: dict[str, Callable[[], object]], *, reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """`interleaved` for any number of contenders: rep r runs them in order (ABC) when r is
    even and reversed (CBA) when odd, so none is always first or always after the same one.
    Returns each one's times, rep by rep (index r of every list is one round). A contender
    that returns a float reports its own seconds (an external tool that times itself, so its
    process start is not counted against it)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            reported = fns[name]()
            elapsed = time.perf_counter() - started
            times[name].append(reported if isinstance(reported, float) else elapsed)
    return times


STEP_PHASES = ("forward", "backward", "clip", "step")


def timed_steps(model, opt, batches, times: dict[str, list[float]], clip: Callable[[], object]) -> None:
    """Training steps of a (x, y) -> (logits, loss) model, one per batch, each phase's ms
    appended to times[phase] (STEP_PHASES; forward includes waiting for the last step's
    pulls, step the pushes until acknowledged)."""
    for x, y in batches:
        t0 = time.perf_counter()
        _, loss = model(x, y)
        t1 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        clip()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        for phase, seconds in zip(STEP_PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[phase].append(1000 * seconds)


def spread(values: list[float]) -> dict:
    """What a skeptic asks of a median of paired ratios: how far the pairs were apart."""
    return {"min": round(min(values), 3), "max": round(max(values), 3), "n": len(values)}


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
    scaled_down: bool = False,
) -> dict:
    """Writes bench/results/NAME.json and prints one line. `ratio` defaults to ours/peer.
    `scaled_down`: a run smaller than the benchmark's own size (a check that it runs): its
    file goes to bench/results/quick/, as under PS_BENCH_QUICK=1, never over the real one."""
    ratio = round(ours / peer if ratio is None else ratio, 3)  # the verdict is on the ratio as recorded
    quick_run = QUICK or scaled_down
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
        "machine": machine(),
        "notes": notes,
        **({"quick": True} if quick_run else {}),
        **(extra or {}),
    }
    results = REPO / "bench" / "results" / "quick" if quick_run else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{name}: ours {ours:.4g} {unit}, peer {peer:.4g} {unit}, ratio {ratio:.3f} "
        f"(target {'>=' if higher_is_better else '<='} {target}: {'met' if met else 'NOT met'})"
    )
    return result


def _cores() -> int:
    import os

    return os.cpu_count() or 0


def machine() -> str:
    """The CPU a figure was measured on: its model and the vector extensions that decide bf16
    and fp32 kernel speed (a bf16 matmul without AVX-512 BF16 or AMX is emulated, many times
    slower, so absolute bf16 times differ between machines by more than any change of ours)."""
    model, flags = "", set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return ", ".join(x for x in (platform.machine(), f"{_cores()} cores", model, "+".join(simd)) if x)


def median(values: list[float]) -> float:
    return statistics.median(values)


def peak_rss(pid: int | str = "self") -> int:
    """A process's peak resident set (VmHWM), in bytes. Not getrusage's ru_maxrss: Linux keeps
    that across execve, so a worker started by a large process (the bench runner) reports the
    runner's peak."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"VmHWM is not in /proc/{pid}/status")


@dataclass(frozen=True)
class ProcessCpu:
    """A process's CPU time so far, in seconds, and its minor page faults (/proc/PID/stat);
    subtract two to get what happened between them."""

    user: float
    system: float
    minor_faults: int

    @classmethod
    def of(cls, pid: int | str = "self") -> ProcessCpu:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        tick = os.sysconf("SC_CLK_TCK")
        return cls(int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7]))

    @property
    def seconds(self) -> float:
        return self.user + self.system

    def __sub__(self, other: ProcessCpu) -> ProcessCpu:
        return ProcessCpu(self.user - other.user, self.system - other.system, self.minor_faults - other.minor_faults)

    def __add__(self, other: ProcessCpu) -> ProcessCpu:
        return ProcessCpu(self.user + other.user, self.system + other.system, self.minor_faults + other.minor_faults)


@dataclass(frozen=True)
class DiskTicks:
    """The block device under a path, from its /sys/dev/block stat: `busy_ms`, the time it had
    I/O in flight (io_ticks), and `flushes` (Linux 5.5 on; 0 before). Subtract two for a span."""

    busy_ms: int
    flushes: int

    @classmethod
    def of(cls, path: str | Path) -> DiskTicks | None:
        """None where the path's file system has no block device (tmpfs, overlay)."""
        dev = os.stat(path).st_dev
        try:
            return cls.of_line(Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text())
        except OSError:
            return None

    @classmethod
    def of_line(cls, line: str) -> DiskTicks:
        """From a block device's stat: 11 fields to Linux 4.18, 15 to 5.4, 17 from 5.5 (the
        10th is io_ticks, the 16th flush requests completed)."""
        fields = [int(v) for v in line.split()]
        return cls(fields[9], fields[15] if len(fields) > 15 else 0)

    def __sub__(self, other: DiskTicks) -> DiskTicks:
        return DiskTicks(self.busy_ms - other.busy_ms, self.flushes - other.flushes)

    def __add__(self, other: DiskTicks) -> DiskTicks:
        return DiskTicks(self.busy_ms + other.busy_ms, self.flushes + other.flushes)


@dataclass(frozen=True)
class CoreTimes:
    """The whole machine's CPU time so far, all cores, in clock ticks (/proc/stat): idle (idle
    and iowait) and total; subtract two to get how busy the cores were between them, whatever
    ran (the trainer, the daemon, anything else on the host)."""

    idle: int
    total: int

    @classmethod
    def now(cls) -> CoreTimes:
        with open("/proc/stat") as f:
            return cls.of_line(f.readline())

    @classmethod
    def of_line(cls, line: str) -> CoreTimes:
        """From /proc/stat's first line: "cpu user nice system idle iowait irq softirq steal guest
        guest_nice" (guest time is counted in user already)."""
        ticks = [int(v) for v in line.split()[1:9]]
        return cls(ticks[3] + ticks[4], sum(ticks))

    def __sub__(self, other: CoreTimes) -> CoreTimes:
        return CoreTimes(self.idle - other.idle, self.total - other.total)

    def __add__(self, other: CoreTimes) -> CoreTimes:
        return CoreTimes(self.idle + other.idle, self.total + other.total)

    @property
    def busy(self) -> float:
        """The share of the cores' time that was not idle."""
        return 1.0 - self.idle / self.total if self.total else 0.0


class BenchDaemon(LocalDaemon):
    """A local daemon in a temporary directory that is removed when it stops."""

    def __init__(self, *extra: str) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="ps-bench-")
        super().__init__(Path(self._tmp.name), "--log-level", "WARNING", *extra)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._tmp.cleanup()


def daemon_stats(address: str) -> ps_pb2.StatsResponse:
    """The daemon's Admin.Stats (counters such as NVMe bytes read and written)."""
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=30)
