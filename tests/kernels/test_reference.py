"""kernels/reference.py, the oracle, against the formats written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from ps_offload import kernels
from ps_offload.kernels import BLOCK, reference
from tests.helpers import kernel_cases as cases


def test_onebit_bits_are_lsb_first_with_unused_bits_zero():
    grad = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 2, 0.5, -0.0, -3])
    bits, scales = reference.onebit_compress(grad, None)
    # element 8*i + j is bit j of byte i; -0.0 counts as >= 0; bits past n are 0
    assert bits.tolist() == [0b1000_0001, 0b0000_0011]
    assert scales.tolist() == [pytest.approx(grad.abs().mean().item(), rel=1e-7)]
    assert reference.onebit_decompress(bits, scales, 11).tolist() == [
        s * scales.item() for s in [1, -1, -1, -1, -1, -1, -1, 1, 1, 1, -1]
    ]


def test_onebit_nan_is_a_zero_bit():
    bits, _ = reference.onebit_compress(torch.tensor([math.nan, 1.0]), None)
    assert bits.tolist() == [0b10]


def test_onebit_scale_is_the_mean_magnitude_of_each_block_partial_last_block_included():
    grad, error = cases.make_input(2 * BLOCK + 100, "normal", "cpu")
    c = grad + error
    _, scales = reference.onebit_compress(grad, error.clone())
    means = [c[start : start + BLOCK].abs().double().mean().item() for start in range(0, c.numel(), BLOCK)]
    # the reference sums in a fixed order; a plain float64 mean rounds to the same float32 or
    # its neighbour
    assert scales.double().tolist() == pytest.approx(means, rel=2e-7)


def test_onebit_scale_bits_do_not_depend_on_padding():
    grad = torch.randn(BLOCK + 3)
    _, scales = reference.onebit_compress(grad, None)
    _, alone = reference.onebit_compress(grad[BLOCK:].clone(), None)
    assert scales[1].item() == alone[0].item()


def test_topk_keeps_the_largest_magnitudes_ties_to_the_lower_index_in_index_order():
    grad = torch.tensor([1.0, -3, 3, 2, -3, 0])
    assert reference.topk_compress(grad, None, 0.5)[0].tolist() == [1, 2, 4]  # k = 3
    indices, values = reference.topk_compress(grad, None, 0.3)  # k = ceil(1.8) = 2
    assert indices.tolist() == [1, 2] and values.tolist() == [-3.0, 3.0]
    assert reference.topk_compress(grad, None, 0.01)[0].tolist() == [1]  # at least one


def test_topk_is_per_block_block_major_with_global_indices():
    n = 2 * BLOCK + 10
    grad = torch.randn(n)
    error = torch.randn(n)
    c = grad + error
    new_error = error.clone()
    indices, values = reference.topk_compress(grad, new_error, 0.01)
    k_full, k_last = math.ceil(0.01 * BLOCK), 1
    assert kernels.topk_count(n, 0.01) == indices.numel() == 2 * k_full + k_last
    assert torch.equal(values, c[indices.long()])
    bounds = [0, k_full, 2 * k_full, 2 * k_full + k_last]
    for b in range(3):
        block = indices[bounds[b] : bounds[b + 1]].long()
        assert bool((block[1:] > block[:-1]).all()), "ascending within a block"
        lo, hi = b * BLOCK, min(n, (b + 1) * BLOCK)
        assert bool(((block >= lo) & (block < hi)).all())
        rest = torch.ones(hi - lo, dtype=torch.bool)
        rest[block - lo] = False
        assert c[block].abs().min() >= c[lo:hi][rest].abs().max()
    expected = c.clone()
    expected[indices.long()] = 0
    assert torch.equal(new_error, expected)


def test_topk_count_is_the_ceiling_of_the_float64_product_per_block():
    assert kernels.topk_count(1, 0.001) == 1
    assert kernels.topk_count(BLOCK, 0.25) == 256
    assert kernels.topk_count(BLOCK + 1, 0.1) == 103 + 1
    assert kernels.topk_count(3 * BLOCK, 1.0) == 3 * BLOCK


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_is_torchs_rounding(dtype):
    grad, error = cases.make_input(3000, "special", "cpu")
    new_error = error.clone()
    values = reference.cast_compress(grad, new_error, dtype)
    assert cases.same(values, (grad + error).to(dtype))
    assert cases.same(new_error, (grad + error) - values.float())


@pytest.mark.parametrize("kind", ["normal", "ties"])
@pytest.mark.parametrize("n", cases.SIZES)
def test_reference_error_feedback_loses_nothing(n, kind):
    """The float64 identity, for the oracle itself (the same checks the kernels pass)."""
    cases.check_onebit(n, "torch", "cpu", kind=kind)
    cases.check_cast(n, torch.bfloat16, "torch", "cpu", kind=kind)
    cases.check_cast(n, torch.float16, "torch", "cpu", kind=kind)
    cases.check_topk(n, 0.1, "torch", "cpu", kind=kind)
