"""kernels/cuda.py under the CUDA simulator: the same checks as the CPU backend, on small
inputs (the simulator runs every thread in Python).

Not collected on its own (no test_ prefix): test_cuda.py runs it in a fresh interpreter with
NUMBA_ENABLE_CUDASIM=1, which must be set before numba is first imported.
"""

from __future__ import annotations

import numba

if not numba.config.ENABLE_CUDASIM:
    raise RuntimeError("run these with NUMBA_ENABLE_CUDASIM=1 (tests/kernels/test_cuda.py does)")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import kernel_cases as cases  # noqa: E402

# the simulator computes in NumPy, which warns where the kernels meet inf - inf on purpose
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)

SIZES = [1, 7, 13, 2 * 1024 + 9]  # the last: three blocks, the third partial


@pytest.mark.parametrize("n", SIZES)
def test_onebit(n):
    cases.check_onebit(n, "cuda", "cpu")


@pytest.mark.parametrize("kind", ["ties", "special"])
def test_onebit_kinds(kind):
    cases.check_onebit(1030, "cuda", "cpu", kind=kind)


@pytest.mark.parametrize("n", [7, 1030])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast(dtype, n):
    cases.check_cast(n, dtype, "cuda", "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_special(dtype):
    cases.check_cast(300, dtype, "cuda", "cpu", kind="special")


@pytest.mark.parametrize(("n", "ratio"), [(1, 0.5), (7, 0.3), (13, 1.0), (2 * 1024 + 9, 0.1)])
def test_topk(n, ratio):
    cases.check_topk(n, ratio, "cuda", "cpu")


@pytest.mark.parametrize(("kind", "ratio"), [("ties", 0.25), ("special", 0.2)])
def test_topk_kinds(kind, ratio):
    cases.check_topk(1030, ratio, "cuda", "cpu", kind=kind)


@pytest.mark.parametrize("kind", ["normal", "nan"])
def test_without_error_feedback(kind):
    cases.check_onebit(1030, "cuda", "cpu", kind=kind, with_error=False)
    cases.check_cast(1030, torch.bfloat16, "cuda", "cpu", kind=kind, with_error=False)
    cases.check_topk(1030, 0.01, "cuda", "cpu", kind=kind, with_error=False)
