"""compress_gpu: gradient compression throughput on a GPU (the Numba CUDA kernels in kernels/)
vs a device-to-device copy of the same bytes. Needs CUDA; without it, it says so and records
nothing (`make bench` skips it).

Ours: kernels.onebit_compress(grad, error) on a 256 MiB fp32 gradient with error feedback, on
torch's current stream. Peer: dst.copy_(grad) of the same bytes on the same stream (reads and
writes them once: the floor of any pass). Both timed with CUDA events, ABBA-interleaved after
warming the JIT; GB/s of fp32 gradient read; ratio = ours / peer (target >= 0.7). The extras
give bf16, fp16 and top-k 1% the same way, and the launch overhead: the host time of one call
on a 1024-element buffer (one thread block), averaged over 200 calls, which is what every
compressed bucket pays on top of its bytes.
"""

from __future__ import annotations

import time

import torch

from bench.common import median, record
from ps_offload import kernels

N = 64 * 2**20  # fp32 elements: 256 MiB
REPS = 20


def _event_time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def _interleaved(ours, peer) -> tuple[list[float], list[float]]:
    ours(), peer(), ours(), peer()  # warm-up (the first call compiles the kernel)
    ours_t, peer_t = [], []
    for rep in range(REPS):
        pair = (ours, peer) if rep % 2 == 0 else (peer, ours)
        times = {fn: _event_time(fn) for fn in pair}
        ours_t.append(times[ours])
        peer_t.append(times[peer])
    return ours_t, peer_t


def _launch_overhead_us() -> float:
    small, error = torch.randn(1024, device="cuda"), torch.zeros(1024, device="cuda")
    kernels.onebit_compress(small, error)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(200):
        kernels.onebit_compress(small, error)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / 200 * 1e6


def main() -> dict | None:
    if not torch.cuda.is_available():
        print("compress_gpu: skipped, no CUDA device")
        return None
    torch.manual_seed(0)
    grad = torch.randn(N, device="cuda")
    error = torch.randn(N, device="cuda") * 0.01
    dst = torch.empty_like(grad)
    bf16 = torch.empty(N, dtype=torch.bfloat16, device="cuda")
    fp16 = torch.empty(N, dtype=torch.float16, device="cuda")
    methods = {
        "onebit": lambda: kernels.onebit_compress(grad, error),
        "bf16": lambda: kernels.cast_compress(grad, error, torch.bfloat16, out=bf16),
        "fp16": lambda: kernels.cast_compress(grad, error, torch.float16, out=fp16),
        "topk_1pct": lambda: kernels.topk_compress(grad, error, 0.01),
    }
    figures = {}
    for name, fn in methods.items():
        ours_t, peer_t = _interleaved(fn, lambda: dst.copy_(grad))
        ours, peer = 4 * N / median(ours_t) / 1e9, 4 * N / median(peer_t) / 1e9
        figures[name] = {"ours_gbps": round(ours, 1), "copy_gbps": round(peer, 1), "ratio": round(ours / peer, 3)}
        print(f"  {name}: {ours:.1f} GB/s vs copy {peer:.1f} GB/s = {ours / peer:.3f}x")
    launch = _launch_overhead_us()
    print(f"  launch overhead: {launch:.1f} us per call (1024 elements)")
    main_figure = figures["onebit"]
    return record(
        "compress_gpu",
        ours=main_figure["ours_gbps"],
        peer=main_figure["copy_gbps"],
        unit="GB/s",
        target=0.7,
        higher_is_better=True,
        notes=f"1-bit compress with error feedback of a {4 * N // 2**20} MiB fp32 gradient (Numba CUDA) vs "
        f"torch d2d copy of the same bytes on {torch.cuda.get_device_name()}; CUDA events, median of {REPS}",
        extra={"methods": figures, "launch_overhead_us": round(launch, 1)},
    )


if __name__ == "__main__":
    main()
