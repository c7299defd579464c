"""Builds DeepSpeed's two ops the benchmarks use as peers (CPU Adam for optimizer_step, async
I/O for nvme_io), so the first `make bench` pays for the compile here, once, and says so,
instead of inside a benchmark. DeepSpeed compiles its ops with ninja on first use into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR); later loads
take about a second. Without DeepSpeed (the `bench` extra) it says so and exits 0: the
benchmarks then record that peer as missing.

torch's extension loader serializes builds with a `lock` file in the op's build directory
and waits, without a word and without end, while it exists; an interrupted build leaves it
behind. So before each build: a lock with no compiler running is removed, saying so; one
with a build running is waited for, saying what for, at most LOCK_WAIT_SECONDS.

    python -m bench.deepspeed_ops
"""

from __future__ import annotations

import time
from pathlib import Path

LOCK_WAIT_SECONDS = 1200.0  # a build of both ops from scratch takes a few minutes here
COMPILERS = ("ninja", "cc1plus", "c++", "g++", "nvcc")


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
        clear_stale_lock(name)
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


def clear_stale_lock(name: str, *, wait_seconds: float = LOCK_WAIT_SECONDS) -> None:
    """Makes sure torch's build lock of extension `name` will not hold its build up forever."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, False)) / "lock"
    if not lock.exists():
        return
    print(f"  {name}: {lock} exists: another build of this op holds it, or an interrupted one left it")
    deadline = time.monotonic() + wait_seconds
    while lock.exists():
        if not compiler_running():
            lock.unlink(missing_ok=True)
            print(f"  {name}: no compiler is running, so an interrupted build left it: removed")
            return
        if time.monotonic() > deadline:
            raise SystemExit(
                f"deepspeed_ops: {lock} is still held after {wait_seconds:.0f}s while a compiler runs; "
                "if no build of DeepSpeed's ops is yours, stop it or remove the file"
            )
        time.sleep(1.0)
    print(f"  {name}: the other build finished")


def compiler_running() -> bool:
    """Whether a compiler or ninja runs on this host now (/proc; False where it cannot tell)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv0 = cmdline.read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if Path(argv0).name in COMPILERS:
            return True
    return False


if __name__ == "__main__":
    main()
