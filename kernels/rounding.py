"""fp32 <-> bf16 / fp16 on bit patterns, as plain Python on integers, so that the same source
compiles as a Numba CPU function (numba.njit) and a Numba CUDA device function (and runs as
is under the CUDA simulator). Round to nearest even, as torch's .to(dtype); NaN stays a quiet
NaN with its sign (its payload is not kept).

All take and return non-negative ints: `u` is a float32's bits (uint32), `h` a 16-bit pattern.

Numba's on-disk cache of kernels/cpu.py watches only cpu.py: after editing this file, delete
kernels/__pycache__/cpu.*.nb* (or touch cpu.py), or the cached kernels keep the old code.
"""

from __future__ import annotations

import numpy as np


def f32_to_bf16(u):
    """bf16 bits of the float32 with bits u."""
    if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN
        return ((u >> 16) & 0x8000) | 0x7FC0
    # adding 0x7FFF plus the kept lowest bit rounds to nearest, ties to even; a carry moves
    # into the exponent (and to infinity past the largest finite bf16), as it should
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


def bf16_to_f32(h):
    """float32 bits of the bf16 with bits h (exact)."""
    return h << 16


def f32_to_f16(u):
    """fp16 bits of the float32 with bits u.

    Branch-free (so it vectorizes): M. Maratyszcza's FP16 library, fp16_ieee_from_fp32_value.
    The magnitude is scaled so that float32 addition of a power of two (chosen from the
    exponent, at least 2**-14 so fp16 subnormals come out right) rounds off exactly the bits
    fp16 cannot hold, nearest even; the sum's exponent and top mantissa bits are the fp16.
    Both products are exact (power-of-two scalings that cannot underflow), so the CUDA
    compiler contracting the second one and the addition into an FMA changes nothing.
    """
    f = np.uint32(u).view(np.float32)
    base = (np.float32(abs(f)) * np.float32(2.0**112)) * np.float32(2.0**-110)  # > 65504: infinity
    w2 = (u + u) & 0xFFFFFFFF  # exponent and mantissa, shifted out of the sign
    bias = max(w2 & 0xFF000000, 0x71000000)
    base = np.uint32((bias >> 1) + 0x07800000).view(np.float32) + base
    bits = np.int64(np.float32(base).view(np.uint32))
    nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF)
    is_nan = -np.int64(w2 > 0xFF000000)
    return ((u & 0x80000000) >> 16) | (0x7E00 & is_nan) | (nonsign & ~is_nan)  # NaN: 0x7E00


def f16_to_f32(h):
    """float32 bits of the fp16 with bits h (exact). Branch-free: every case is computed, one
    is selected."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    special = sign | 0x7F800000 | (m << 13)  # infinity, NaN
    normal = sign | ((e + 112) << 23) | (m << 13)  # rebias the exponent (15 -> 127)
    # m * 2**-24 as (0.5 + m * 2**-24) - 0.5, both exact: no int-to-float conversion, which
    # x86 cannot vectorize from int64
    subnormal = sign | np.int64(
        np.float32(np.uint32(0x3F000000 | m).view(np.float32) - np.float32(0.5)).view(np.uint32)
    )
    # selects as masks: Numba lowers `x if c else y` to branches, which stop vectorization
    is_special, is_zero_exponent = -np.int64(e == 31), -np.int64(e == 0)
    finite = (subnormal & is_zero_exponent) | (normal & ~is_zero_exponent)
    return (special & is_special) | (finite & ~is_special)
