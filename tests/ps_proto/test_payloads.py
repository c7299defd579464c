"""The payload layouts of the contract agree with the kernels that fill them."""

from __future__ import annotations

import pytest
import torch

from ps_offload import kernels
from ps_offload.proto import payloads


def test_block_is_the_kernels_block():
    assert payloads.BLOCK == kernels.BLOCK


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1023, 1024, 1025, 3 * 1024 + 5])
def test_onebit_layout_matches_what_the_kernels_produce(numel):
    bits, scales = kernels.onebit_compress(torch.randn(numel), torch.zeros(numel), backend="torch")
    assert payloads.onebit_sign_offset(numel) == 4 * scales.numel()
    assert payloads.onebit_nbytes(numel) == 4 * scales.numel() + bits.numel()


@pytest.mark.parametrize(
    ("nbytes", "k"), [(0, None), (4, None), (11, None), (12, 1), (13, None), (20, 2), (4 + 8 * 1000, 1000)]
)
def test_topk_count_inverts_topk_nbytes(nbytes, k):
    assert payloads.topk_count(nbytes) == k
    if k is not None:
        assert payloads.topk_nbytes(k) == nbytes
        assert payloads.topk_value_offset(k) == 4 + 4 * k
