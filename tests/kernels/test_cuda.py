"""kernels/cuda.py (Numba CUDA): under the CUDA simulator on every machine (in a subprocess,
see cuda_sim_cases.py), and on a real GPU where there is one (marked gpu)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import kernel_cases as cases

HERE = Path(__file__).resolve().parent
SIM_CASES = 20  # tests in cuda_sim_cases.py; all must run and pass
# Two runs of about half the cases each (the simulator is slow: one run of all took ~90 s on a
# loaded 2-core machine, half the per-test timeout); together they must be every case.
SIM_RUNS = {"onebit or without_error_feedback": 8, "cast or topk": 12}


@pytest.mark.parametrize("keyword", list(SIM_RUNS))
def test_cuda_kernels_under_the_simulator(keyword):
    assert sum(SIM_RUNS.values()) == SIM_CASES
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "cuda_sim_cases.py"),
            "-k",
            keyword,
        ],
        env=env,
        cwd=HERE.parents[1],
        capture_output=True,
        text=True,
        timeout=170,
    )
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    # exit status 5 (nothing collected) or anything else but 0 fails, and so does a run
    # where fewer cases passed than this run's share (skips, a case renamed out of both runs)
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == SIM_RUNS[keyword], report
    assert not re.search(r"\d+ (skipped|xfailed)", proc.stdout), report


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SIZES = [*cases.SIZES, 300 * 1024 + 77]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", cases.KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_gpu_onebit(n, kind):
    cases.check_onebit(n, "cuda", "cuda", kind=kind)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", cases.KINDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_cast(dtype, n, kind):
    cases.check_cast(n, dtype, "cuda", "cuda", kind=kind)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", cases.KINDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ratio", [0.01, 0.1, 1.0])
def test_gpu_topk(ratio, n, kind):
    cases.check_topk(n, ratio, "cuda", "cuda", kind=kind)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["normal", "nan"])
def test_gpu_without_error_feedback(kind):
    cases.check_onebit(5000, "cuda", "cuda", kind=kind, with_error=False)
    cases.check_cast(5000, torch.float16, "cuda", "cuda", kind=kind, with_error=False)
    cases.check_topk(5000, 0.1, "cuda", "cuda", kind=kind, with_error=False)


@pytest.mark.gpu
@gpu
def test_gpu_kernels_run_on_torchs_current_stream():
    """Launched on a side stream, the kernels are ordered after the work queued there and
    before what follows, with no synchronization of their own."""
    from ps_offload import kernels

    n = 1 << 22
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        grad = torch.randn(n, device="cuda")
        error = torch.randn(n, device="cuda") * 0.1
        expected_error = error.clone()
        bits_ref, scales_ref = kernels.onebit_compress(grad, expected_error, backend="torch")
        grad.mul_(1.0)  # queued right before the kernel on the same stream
        bits, scales = kernels.onebit_compress(grad, error)
        decompressed = kernels.onebit_decompress(bits, scales, n)
    side.synchronize()
    assert torch.equal(bits, bits_ref) and torch.equal(scales, scales_ref) and torch.equal(error, expected_error)
    assert torch.equal(decompressed, kernels.onebit_decompress(bits_ref, scales_ref, n, backend="torch"))
