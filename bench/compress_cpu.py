"""compress_cpu: gradient compression throughput on the CPU (the Numba kernels in kernels/)
vs a memory copy of the same bytes.

Ours: kernels.onebit_compress(grad, error) on a 64 MiB fp32 gradient with error feedback
(reads grad and error, writes the new error, the sign bits and the scales). Peer: torch's
dst.copy_(grad) of the same 64 MiB (reads it once, writes it once), the floor any pass over
the gradient pays. Both in GB/s of fp32 gradient read (4 * n bytes / time), run interleaved
ABBA after warming the JIT; ratio = ours / peer (higher is better; target >= 0.5: a naive
two-pass Numba probe reached about 0.07x). Numba and torch use their default thread counts
(every core).

The extras give the same figure for bf16 and fp16 casts into a preallocated output (as the
copy's), bf16 into a fresh tensor per call (the page faults of 32 MiB of new memory cost
about as much as the kernel), top-k at 1% (all with error feedback), and 1-bit without error
feedback, each against its own interleaved copy.
"""

from __future__ import annotations

import numba
import torch

from bench.common import interleaved, median, record
from ps_offload import kernels

N = 16 * 2**20  # fp32 elements: 64 MiB
REPS = 30


def _gbps(seconds: float) -> float:
    return 4 * N / seconds / 1e9


def main() -> dict:
    torch.manual_seed(0)
    grad = torch.randn(N)
    error = torch.randn(N) * 0.01
    dst = torch.empty(N)

    def copy() -> None:
        dst.copy_(grad)

    bf16, fp16 = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.float16)

    methods = {
        "onebit": lambda: kernels.onebit_compress(grad, error),
        "onebit_no_error": lambda: kernels.onebit_compress(grad, None),
        "bf16": lambda: kernels.cast_compress(grad, error, torch.bfloat16, out=bf16),
        "bf16_fresh_output": lambda: kernels.cast_compress(grad, error, torch.bfloat16),
        "fp16": lambda: kernels.cast_compress(grad, error, torch.float16, out=fp16),
        "topk_1pct": lambda: kernels.topk_compress(grad, error, 0.01),
    }
    figures = {}
    for name, fn in methods.items():
        fn()  # JIT compile (or load from the cache) before timing
        ours_t, peer_t = interleaved(fn, copy, reps=REPS, warmup=2)
        ours, peer = _gbps(median(ours_t)), _gbps(median(peer_t))
        figures[name] = {"ours_gbps": round(ours, 3), "copy_gbps": round(peer, 3), "ratio": round(ours / peer, 3)}
        print(f"  {name}: {ours:.3f} GB/s vs copy {peer:.3f} GB/s = {ours / peer:.3f}x")

    main_figure = figures["onebit"]
    return record(
        "compress_cpu",
        ours=main_figure["ours_gbps"],
        peer=main_figure["copy_gbps"],
        unit="GB/s",
        target=0.5,
        higher_is_better=True,
        notes=f"1-bit compress with error feedback of a {4 * N // 2**20} MiB fp32 gradient (Numba CPU, "
        f"{numba.get_num_threads()} threads) vs torch dst.copy_(src) of the same bytes; GB/s of fp32 read; "
        f"median of {REPS} ABBA-interleaved runs",
        extra={"methods": figures},
    )


if __name__ == "__main__":
    main()
