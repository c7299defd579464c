"""Builds DeepSpeed's two ops the benchmarks use as peers (CPU Adam for optimizer_step, async
I/O for nvme_io), so the first `make bench` pays for the compile here, once, and says so,
instead of inside a benchmark. DeepSpeed compiles its ops with ninja on first use into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR); later loads
take about a second. Without DeepSpeed (the `bench` extra) it says so and exits 0: the
benchmarks then record that peer as missing.

    python -m bench.deepspeed_ops
"""

from __future__ import annotations

import time


def main() -> dict[str, float | str]:
    try:
        import deepspeed
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    except ImportError:
        print("deepspeed_ops: DeepSpeed is not installed (the `bench` extra); its peers will be recorded as missing")
        return {}
    print(f"deepspeed_ops: DeepSpeed {deepspeed.__version__} on torch {torch.__version__}")
    seconds: dict[str, float | str] = {}
    for name, builder in (("cpu_adam", CPUAdamBuilder()), ("async_io", AsyncIOBuilder())):
        if not builder.is_compatible(verbose=False):
            seconds[name] = "not buildable here (async_io needs libaio-dev)"
            print(f"  {name}: {seconds[name]}")
            continue
        started = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as exc:  # a failed compile: the benchmark records the peer as missing
            seconds[name] = f"failed: {exc}"
        else:
            seconds[name] = round(time.perf_counter() - started, 1)
        unit = " s (compiled now, or loaded from the cache)" if isinstance(seconds[name], float) else ""
        print(f"  {name}: {seconds[name]}{unit}")
    return seconds


if __name__ == "__main__":
    main()
