"""The benchmarks' shared machinery: ABC CBA interleaving, the CPU and page-fault counts, the
machine's busy cores, the disk's busy time and flushes, and the doc's generated parts."""

from __future__ import annotations

import mmap
import os
import time

from bench import run_all
from bench.common import CoreTimes, DiskTicks, ProcessCpu, interleaved_many, spread


def test_interleaved_many_alternates_the_order_and_takes_reported_seconds():
    calls: list[str] = []

    def contender(name: str, reported: float | None = None):
        def run():
            calls.append(name)
            return reported

        return run

    times = interleaved_many({"a": contender("a"), "b": contender("b", 0.5), "c": contender("c")}, reps=2, warmup=0)
    assert calls == ["a", "b", "c", "c", "b", "a"]
    assert times["b"] == [0.5, 0.5]  # an external tool's own timing is kept
    assert len(times["a"]) == len(times["c"]) == 2


def test_generated_table_and_status_quote_the_result_file():
    r = {
        "name": "nvme_read", "ours": 1.0, "peer": 2.0, "unit": "GB/s", "ratio": 0.5, "target": 0.9,
        "higher_is_better": True, "target_met": False, "date": "2026-01-01", "ratio_spread": spread([0.4, 0.5, 0.6]),
        "bytes": 1 << 30, "gbps": {"ours": 1.0, "fio": 2.0}, "ratio_vs_fio": 0.5,
        "peer_missing": {"deepspeed": "not installed"}, "bench_seconds": 12.3,
    }  # fmt: skip
    table = run_all.table({"nvme_read": r})
    assert "| `nvme_read` | 1.0 | 2.0 | GB/s | **0.5** | 0.4–0.6 (3) | ≥ 0.9 | no | 2026-01-01 | 12.3 |" in table
    status = run_all.status({"nvme_read": r})
    assert "not met, 0.5×" in status and "fio 2.0" in status and "deepspeed (not installed)" in status


def test_process_cpu_counts_this_processes_work_and_its_page_faults():
    pages = mmap.mmap(-1, 64 << 20)
    # Where transparent huge pages are "always" (CI's machine), one fault maps 2 MiB: ask for
    # 4 KiB pages so that each first write below faults exactly one page in.
    pages.madvise(mmap.MADV_NOHUGEPAGE)
    before = ProcessCpu.of()
    for at in range(0, len(pages), mmap.PAGESIZE):
        pages[at] = 1
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    used = ProcessCpu.of() - before
    assert used.minor_faults >= (64 << 20) // mmap.PAGESIZE // 2  # the kernel may still map a few pages per fault
    assert used.seconds >= 0.04 and used.user >= 0 and used.system >= 0
    assert ProcessCpu.of(os.getpid()).seconds >= ProcessCpu.of().seconds - 0.1  # by pid, the same process
    pages.close()


def test_core_times_count_a_spinning_thread_as_busy_and_the_whole_machine_in_the_total():
    cores = os.cpu_count() or 1
    before, process_before = CoreTimes.now(), ProcessCpu.of()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    used, spent = CoreTimes.now() - before, ProcessCpu.of() - process_before
    ticks = os.sysconf("SC_CLK_TCK")
    # The total counts every core's time: at least the spin's own, and its busy part at least
    # what this process used (less a tick per core of rounding), whatever else ran meanwhile.
    assert used.total >= spent.seconds * ticks - cores
    assert (used.total - used.idle) >= spent.seconds * ticks - 2 * cores
    assert 0.0 < used.busy <= 1.0
    assert CoreTimes(0, 0).busy == 0.0 and CoreTimes(1, 4).busy == 0.75


def test_core_times_take_idle_and_iowait_as_idle_and_leave_guest_time_out_of_the_total():
    # user nice system idle iowait irq softirq steal guest guest_nice
    times = CoreTimes.of_line("cpu  100 2 30 400 50 6 7 8 90 10\n")
    assert times == CoreTimes(idle=450, total=603)  # guest (90, 10) is inside user already


def test_disk_ticks_read_io_ticks_and_flushes_from_each_kernels_stat_layout():
    # reads: ios merges sectors ms; writes: the same; in_flight io_ticks time_in_queue;
    # discards: 4 fields (4.18 on); flushes: ios ms (5.5 on)
    newest = (
        "476160 68606 378052962 2114922 364093 445971 350698184 1747260 0 524596 4067308 "
        "229369 46 56951704 57756 83819 147369"
    )
    assert DiskTicks.of_line(newest + "\n") == DiskTicks(busy_ms=524596, flushes=83819)
    oldest = " ".join(newest.split()[:11])  # before 4.18: no discards, no flushes
    assert DiskTicks.of_line(oldest) == DiskTicks(busy_ms=524596, flushes=0)
    span = DiskTicks.of_line(newest) - DiskTicks(busy_ms=524000, flushes=83800)
    assert span + span == DiskTicks(busy_ms=1192, flushes=38)


def test_disk_ticks_are_none_where_no_block_device_holds_the_path():
    assert DiskTicks.of("/dev/shm") is None  # tmpfs
    assert DiskTicks.of("/proc") is None
