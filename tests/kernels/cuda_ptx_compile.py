"""Compiles every Numba CUDA kernel of kernels/cuda.py to PTX for sm_90 (an H100), with the
argument types its entry points launch it with, on a machine without a GPU: numba-cuda's
compile_ptx types and lowers the kernel as a real launch would, which the CUDA simulator does
not (it runs the Python code on numpy arrays). Run by test_cuda_ptx.py in a subprocess
without NUMBA_ENABLE_CUDASIM; prints one JSON object per line:

    {"skip": reason}                                     libNVVM or NVRTC is missing
    {"kernel": name, "signature": ..., "ptx_bytes": n}   one compiled (kernel, signature)
    {"error": ...}                                       a kernel no entry point launched

The kernels are every kernel dispatcher in the module (device functions are compiled as part
of the kernels that call them), so a new kernel is covered once an entry point below launches
it, and fails the run until one does. Each entry point is driven once per dtype it takes, with
the module's own argument wrapping (its simulator branch: numpy arrays, which Numba types as
it types the device arrays of a real launch: array(float32, 1d, C), ...).
"""

from __future__ import annotations

import json
import os
import sys

CC = (9, 0)


def _libraries_missing() -> str | None:
    from cuda.pathfinder import DynamicLibNotFoundError, load_nvidia_dynamic_lib

    for lib in ("nvrtc", "nvvm"):
        try:
            load_nvidia_dynamic_lib(lib)
        except DynamicLibNotFoundError as e:
            return f"lib{lib} not found ({str(e).splitlines()[0]})"
    return None


class _Recorder:
    """Stands in for a kernel: `kernel[blocks, threads](*args)` records the arguments' types."""

    def __init__(self, name: str, seen: dict[str, set]) -> None:
        self.name, self.seen = name, seen

    def __getitem__(self, config):
        import numba

        def launch(*args):
            self.seen[self.name].add(tuple(numba.typeof(a) for a in args))

        return launch


def _drive(kc) -> None:
    """Every entry point of kernels/cuda.py, with and without error feedback, a partial and a
    multi-block size, every output dtype it takes."""
    import torch

    from ps_offload import kernels

    for n in (1000, 3000):
        grad = torch.randn(n)
        for error in (None, torch.zeros(n)):
            blocks = -(-n // kernels.BLOCK)
            bits, scales = torch.empty(-(-n // 8), dtype=torch.uint8), torch.empty(blocks)
            kc.onebit_compress(grad, error, bits, scales)
            kc.onebit_decompress(bits, scales, torch.empty(n))
            for dtype in (torch.bfloat16, torch.float16):
                kc.cast_compress(grad, error, torch.empty(n, dtype=dtype))
            k = kernels.topk_count(n, 0.1)
            indices, values = torch.zeros(k, dtype=torch.int32), torch.empty(k)
            kc.topk_compress(grad, error, 103, 103, indices, values)
            kc.topk_decompress(indices, values, torch.empty(n))


def main() -> int:
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        print(json.dumps({"error": "run without NUMBA_ENABLE_CUDASIM: the simulator compiles nothing"}))
        return 1
    missing = _libraries_missing()
    if missing:
        print(json.dumps({"skip": missing}))
        return 0
    import types

    from numba import cuda
    from numba.cuda import dispatcher
    from numba.cuda.dispatcher import CUDADispatcher

    from ps_offload.kernels import cuda as kc

    # A kernel's call of a device function (cuda.jit(device=True)) compiles that function for
    # the current device's compute capability, which asks the driver: say it is an sm_90.
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=CC)

    kernels = {
        name: obj
        for name, obj in vars(kc).items()
        if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device")
    }
    seen: dict[str, set] = {name: set() for name in kernels}
    kc._SIM = True  # _launch and _dev take their simulator branch: numpy views, no device
    for name in kernels:
        setattr(kc, name, _Recorder(name, seen))
    _drive(kc)
    failed = 0
    for name, kernel in kernels.items():
        if not seen[name]:
            print(json.dumps({"error": f"no entry point launched kernel {name}: add it to _drive"}))
            failed = 1
        for signature in sorted(seen[name], key=str):
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=CC)
            if f".target sm_{CC[0]}{CC[1]}" not in ptx or ".entry" not in ptx:
                print(json.dumps({"error": f"{name}{signature}: no sm_90 entry in the PTX"}))
                failed = 1
            print(json.dumps({"kernel": name, "signature": str(signature), "ptx_bytes": len(ptx)}))
    return failed


if __name__ == "__main__":
    sys.exit(main())
