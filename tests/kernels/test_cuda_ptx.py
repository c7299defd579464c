"""kernels/cuda.py compiled for an H100 (sm_90) on the CPU: every Numba CUDA kernel, with the
argument types its entry points launch it with (fp32, bf16 and fp16 as uint16, uint8 and int32
arrays), through numba-cuda's compile_ptx, which types and lowers the code as a launch on a
GPU would (the simulator runs it as Python, so a typing error there passes). In a subprocess
without NUMBA_ENABLE_CUDASIM (tests/kernels/cuda_ptx_compile.py). Needs libNVVM and NVRTC,
which the `cuda-toolkit[nvrtc,nvvm]` wheels bring; skipped, saying so, where they are absent.
Also: the launcher wraps tensors for Numba inside the tensor's device context."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
KERNELS = {"_onebit_compress", "_onebit_decompress", "_cast_compress", "_topk_compress", "_topk_decompress"}


@pytest.mark.slow
def test_every_cuda_kernel_compiles_to_ptx_for_sm_90():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "cuda_ptx_compile.py")],
        env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    report = proc.stdout[-4000:] + proc.stderr[-4000:]
    skips = [line["skip"] for line in lines if "skip" in line]
    if skips:
        pytest.skip(f"{skips[0]}: pip install 'cuda-toolkit[nvrtc,nvvm]==13.*' (numba-cuda's cu13 extra has them)")
    assert proc.returncode == 0, report
    assert not [line for line in lines if "error" in line], report
    compiled = {line["kernel"] for line in lines if "kernel" in line}
    assert KERNELS <= compiled, report  # at least the kernels there are today (new ones are found by the run)
    cast = [line["signature"] for line in lines if line.get("kernel") == "_cast_compress"]
    assert any("uint16" in s for s in cast), cast  # bf16 / fp16 values, as uint16


def test_tensors_are_wrapped_inside_the_tensors_device_context(monkeypatch):
    """On a node of several GPUs, Numba ties a wrapped array to the context current when it
    is wrapped: wrapping before switching to the tensor's device would take cuda:1's memory
    for cuda:0's. A stand-in for numba.cuda records the order."""
    from ps_offload.kernels import cuda as kc

    log: list[tuple[str, object]] = []
    current: list[object] = ["no context"]

    class Gpu:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            log.append(("enter", self.index))
            current[0] = self.index

        def __exit__(self, *exc):
            log.append(("exit", self.index))
            current[0] = "no context"

    class Gpus:
        def __getitem__(self, index):
            return Gpu(index)

    def as_cuda_array(t, sync=True):
        log.append(("wrap", current[0]))
        return t

    class Kernel:
        def __getitem__(self, config):
            return lambda *args: log.append(("launch", current[0]))

    fake = types.SimpleNamespace(gpus=Gpus(), as_cuda_array=as_cuda_array, external_stream=lambda handle: None)
    monkeypatch.setattr(kc, "cuda", fake)
    monkeypatch.setattr(kc, "_SIM", False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(kc, "_cast_compress", Kernel())
    grad, error, values = torch.randn(10), torch.zeros(10), torch.empty(10, dtype=torch.bfloat16)
    kc.cast_compress(grad, error, values)
    index = grad.device.index  # (a CPU tensor's: None; a cuda:1 tensor's: 1)
    assert log == [("enter", index), ("wrap", index), ("wrap", index), ("wrap", index), ("launch", index),
                   ("exit", index)]  # fmt: skip


def test_a_numpy_numba_cuda_cannot_compile_with_is_named_at_import():
    """numba-cuda 0.30.4's first compile registers an overload of np.row_stack, which numpy 2.5
    removed: on the GPU image (numpy 2.5.2) every kernel failed with an AttributeError deep in
    its first launch. Importing the kernels says so instead, naming the way out; here numpy
    without row_stack stands in for 2.5 (without the simulator, as on a GPU)."""
    code = (
        "import numpy\n"
        "numpy.__dict__.pop('row_stack', None)\n"
        "try:\n"
        "    import ps_offload.kernels.cuda\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ImportError: numba-cuda" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "numpy<2.5" in proc.stdout and "row_stack" in proc.stdout, proc.stdout
