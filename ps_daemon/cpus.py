"""The CPUs a daemon runs on, how it shares them, and its optimizer's threads (server.cpus,
server.scheduling, store.optimizer_threads).

A daemon beside GPU trainers shares their host: each rank needs a core of its own for its
Python, its launches and its copies, or the GPU waits for the daemon's step to let it run.
So by default the optimizer takes the CPUs the daemon may run on less one per GPU of the
host (`/dev/nvidia<N>`; at least one), and `server.cpus` confines every thread of the daemon
(gRPC, the data plane, the NVMe tier's I/O, the optimizer's) to the CPUs named, the rest
being the trainers'. Where the daemon shares the compute's cores instead, `server.scheduling`
"idle" puts its threads at SCHED_IDLE, below every normal thread of the host. Applied once,
first thing in `run`, in the main thread and every thread already started: threads started
later inherit the main thread's CPUs and policy.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass

from ps_offload.daemon.config import parse_cpu_list

log = logging.getLogger(__name__)


def host_gpus() -> int:
    """The NVIDIA GPUs of this host, by their device files (no CUDA is loaded for it)."""
    return len([p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)])


@dataclass(frozen=True)
class CpuPlan:
    """Where the daemon runs: its CPUs, its optimizer's threads, and whether its threads yield
    their cores to every other thread (SCHED_IDLE)."""

    cpus: frozenset[int]
    optimizer_threads: int
    idle: bool = False

    def describe(self) -> str:
        where = f"{len(self.cpus)} CPUs ({format_cpu_list(self.cpus)}), {self.optimizer_threads} optimizer threads"
        return where + (", at SCHED_IDLE" if self.idle else "")


def plan(cpus: str, optimizer_threads: int, scheduling: str = "normal") -> CpuPlan:
    """The plan for `server.cpus` ("" keeps the CPUs the daemon started with),
    `store.optimizer_threads` (0: those CPUs less one per GPU of the host, at least one) and
    `server.scheduling`. OSError when a named CPU is not one this process may run on."""
    allowed = frozenset(os.sched_getaffinity(0))
    chosen = parse_cpu_list(cpus) if cpus else allowed
    outside = chosen - allowed
    if outside:
        raise OSError(
            f"server.cpus names CPUs {format_cpu_list(outside)} this daemon may not run on (it may run on "
            f"{format_cpu_list(allowed)}: its cgroup's cpuset, systemd's CPUAffinity= or taskset)"
        )
    return CpuPlan(chosen, optimizer_threads or max(1, len(chosen) - host_gpus()), idle=scheduling == "idle")


def apply(cpu_plan: CpuPlan) -> None:
    """Confines every thread of this process to the plan's CPUs, at SCHED_IDLE if it says so,
    and sets the optimizer's threads (torch's, for its kernels, and the one-pass kernel's)."""
    import torch  # (late: the CLI loads torch after its config is checked)

    from ps_offload.kernels import fused_step

    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpu_plan.cpus)
            if cpu_plan.idle:  # (no privilege needed to lower one's own policy)
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    torch.set_num_threads(cpu_plan.optimizer_threads)
    fused_step.set_threads(cpu_plan.optimizer_threads)
    log.info("running on %s", cpu_plan.describe())


def format_cpu_list(cpus: frozenset[int]) -> str:
    """ "0-3,8" for {0, 1, 2, 3, 8}."""
    ordered, runs = sorted(cpus), []
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
