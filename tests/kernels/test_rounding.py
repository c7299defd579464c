"""kernels/rounding.py (fp32 <-> bf16 / fp16 on bits) against torch's conversions.

Here on a structured sample: every sign, exponent and top 7 mantissa bits (all 2**16 upper
halves) with the lower halves at each rounding edge. The conversions were also checked
against torch on all 2**32 float32 bit patterns once (0 differences outside NaN payloads).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from numba import prange

from ps_offload.kernels import rounding

_to = {torch.bfloat16: numba.njit(rounding.f32_to_bf16), torch.float16: numba.njit(rounding.f32_to_f16)}
_from = {torch.bfloat16: numba.njit(rounding.bf16_to_f32), torch.float16: numba.njit(rounding.f16_to_f32)}


@numba.njit(parallel=True)
def _apply(fn, x, out):
    for i in prange(x.size):
        out[i] = fn(np.int64(x[i]))


def _sample() -> np.ndarray:
    high = np.arange(2**16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0x8001, 0xA5A5, 0xFFFF], dtype=np.uint32)
    return (high[:, None] | low[None, :]).ravel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrowing_rounds_as_torch(dtype):
    u = _sample()
    ours = np.empty(u.size, np.uint16)
    _apply(_to[dtype], u, ours)
    theirs = torch.from_numpy(u.view(np.float32)).to(dtype).view(torch.uint16).numpy()
    nan = np.isnan(u.view(np.float32))
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(torch.from_numpy(ours[nan]).view(dtype).float().numpy()).all()  # NaN stays NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widening_is_exact_for_every_16_bit_pattern(dtype):
    h = np.arange(2**16, dtype=np.uint16)
    ours = np.empty(h.size, np.uint32)
    _apply(_from[dtype], h, ours)
    theirs = torch.from_numpy(h).view(dtype).float().view(torch.int32).numpy().view(np.uint32)
    nan = np.isnan(theirs.view(np.float32))
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(ours[nan].view(np.float32)).all()
