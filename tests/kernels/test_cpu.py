"""kernels/cpu.py (Numba CPU) against the torch reference: bit for bit, and error feedback
that loses nothing (tests/helpers/kernel_cases.py says what each check asserts)."""

from __future__ import annotations

import threading

import pytest
import torch

from ps_offload import kernels
from tests.helpers import kernel_cases as cases

RATIOS = [0.01, 0.1, 0.5, 1.0]


@pytest.mark.parametrize("kind", cases.KINDS)
@pytest.mark.parametrize("n", cases.SIZES)
def test_onebit(n, kind):
    cases.check_onebit(n, "cpu", "cpu", kind=kind)


@pytest.mark.parametrize("kind", cases.KINDS)
@pytest.mark.parametrize("n", cases.SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast(dtype, n, kind):
    cases.check_cast(n, dtype, "cpu", "cpu", kind=kind)


@pytest.mark.parametrize("kind", cases.KINDS)
@pytest.mark.parametrize("n", cases.SIZES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_topk(ratio, n, kind):
    cases.check_topk(n, ratio, "cpu", "cpu", kind=kind)


@pytest.mark.parametrize("kind", ["normal", "nan"])
@pytest.mark.parametrize("n", [7, 3 * 1024 + 5])
def test_without_error_feedback(n, kind):
    cases.check_onebit(n, "cpu", "cpu", kind=kind, with_error=False)
    cases.check_cast(n, torch.bfloat16, "cpu", "cpu", kind=kind, with_error=False)
    cases.check_cast(n, torch.float16, "cpu", "cpu", kind=kind, with_error=False)
    cases.check_topk(n, 0.1, "cpu", "cpu", kind=kind, with_error=False)


def test_many_blocks_across_threads():
    n = 64 * 1024 + 999
    cases.check_onebit(n, "cpu", "cpu")
    cases.check_cast(n, torch.bfloat16, "cpu", "cpu")
    cases.check_topk(n, 0.05, "cpu", "cpu")


def test_concurrent_calls_from_python_threads():
    """The daemon and trainer call from several threads; each call must still be right."""
    grads = [torch.randn(20_000) for _ in range(4)]
    expected = [kernels.onebit_compress(g, None, backend="torch") for g in grads]
    results = [None] * len(grads)

    def work(i):
        for _ in range(5):
            results[i] = kernels.onebit_compress(grads[i], None)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(grads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (bits, scales), (bits_ref, scales_ref) in zip(results, expected, strict=True):
        assert torch.equal(bits, bits_ref) and torch.equal(scales, scales_ref)
