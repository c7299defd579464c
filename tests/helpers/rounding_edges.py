"""fp32 values at the edges of bf16 and fp16 rounding (ties either way, overflow to inf,
subnormals, NaNs with payloads and signs, infinities, signed zeros), for the daemon's narrow
pulls and the trainer's, checked against torch's own cast."""

from __future__ import annotations

import math

import torch

EDGE_FLOATS = [
    0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 0.1, -3.14159,
    # bf16 keeps 8 significant bits: each of these is halfway, and goes to the even neighbour
    1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), -(1 + 3 * 2**-8), 257.0, 259.0, 1 + 2**-8 + 2**-20,
    # fp16 keeps 11: the same for it
    1 + 2**-11, 1 + 3 * 2**-11, 2049.0, 2051.0, -2049.0, 1 + 2**-11 + 2**-20,
    # fp16's largest is 65504; 65520 is the tie with 65536, which is past it: inf
    65504.0, 65519.0, 65520.0, -65520.0, 70000.0, 1e10, 3.0e38,
    # fp16 subnormals (2**-24 the smallest), ties among them, and below them
    2**-24, 2**-25, 3 * 2**-25, 5 * 2**-25, 2**-14 - 2**-24, 2**-14, 6e-8, 1e-7, -(2**-24), 1e-9,
    # fp32 subnormals (bf16 has them too), and fp32's largest, which bf16 rounds to inf
    1e-40, -1e-40, 2**-149, 3.4028234663852886e38, -3.4028234663852886e38,
]  # fmt: skip
EDGE_NAN_BITS = [0x7F800001, 0xFFC00000, 0x7FC00001, 0x7FFFFFFF]  # signalling, negative, with payloads


def edge_values() -> torch.Tensor:
    """fp32 values that exercise bf16 and fp16 rounding: ties either way, overflow to inf,
    subnormals, NaNs (with payloads and signs), infinities and signed zeros."""
    floats = torch.tensor(EDGE_FLOATS, dtype=torch.float32)
    nans = torch.tensor(EDGE_NAN_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([floats, nans])
