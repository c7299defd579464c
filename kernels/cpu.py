"""Numba CPU kernels: parallel over blocks (prange), one pass over main memory.

Each block's 4 KiB of grad and error is read once: a first sweep computes c = grad + error
(kept in the error buffer, which stays in L1/L2) and whatever the block needs (the abs-sum,
the top-k keys), a second sweep over the same, now cached, block writes the output and the
new error. Nothing leaves the block, so blocks run on any core in any order.

Inputs are torch tensors already checked by kernels/__init__.py; they are handed to Numba as
NumPy views of the same memory (no copies). Without error feedback the kernels get grad in
the error slot and has_error=False, and never write it.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import prange

from ps_offload.kernels import BLOCK, LANES, ROWS, rounding

_jit = numba.njit(parallel=True, fastmath=False, cache=True, nogil=True)
_f32_to_bf16 = numba.njit(inline="always")(rounding.f32_to_bf16)
_bf16_to_f32 = numba.njit(inline="always")(rounding.bf16_to_f32)
_f32_to_f16 = numba.njit(inline="always")(rounding.f32_to_f16)
_f16_to_f32 = numba.njit(inline="always")(rounding.f16_to_f32)

# One kernel at a time per process: each call already uses every core, and Numba's fallback
# threading layer (workqueue, where OpenMP and TBB are missing) aborts on concurrent launches.
_LOCK = threading.Lock()


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.uint16)
    return t.detach().numpy()


def _error(grad: torch.Tensor, error: torch.Tensor | None) -> tuple[np.ndarray, bool]:
    return (_np(grad), False) if error is None else (_np(error), True)


# --- 1-bit -------------------------------------------------------------------------------


def onebit_compress(grad: torch.Tensor, error: torch.Tensor | None, bits: torch.Tensor, scales: torch.Tensor) -> None:
    err, has_error = _error(grad, error)
    with _LOCK:
        _onebit_compress(_np(grad), err, has_error, _np(bits), _np(scales))


@_jit
def _onebit_compress(grad, error, has_error, bits, scales):
    n = grad.size
    for b in prange(scales.size):
        start = b * BLOCK
        length = min(BLOCK, n - start)
        # block-local views: their indices are provably >= 0, so Numba adds no wraparound
        # code and LLVM vectorizes the sweeps (10x faster than indexing the whole buffer)
        g = grad[start : start + length]
        e = error[start : start + length]
        c_at = e if has_error else g  # where c is after the first sweep
        out = bits[start // 8 : start // 8 + (length + 7) // 8]
        positive = np.zeros(BLOCK, np.uint8)  # c >= 0, one byte each; 8 of them read as a word
        words = positive.view(np.uint64)

        # sweep 1: c, its sign, and |c| summed in the fixed order (lane t: elements r*LANES + t)
        lanes = np.zeros(LANES, np.float64)
        for r in range(ROWS):
            row = r * LANES
            width = max(0, min(LANES, length - row))
            if has_error:
                for t in range(width):
                    c = g[row + t] + e[row + t]
                    e[row + t] = c
                    positive[row + t] = c >= 0
                    lanes[t] += abs(c)
            else:
                for t in range(width):
                    c = g[row + t]
                    positive[row + t] = c >= 0
                    lanes[t] += abs(c)
        s = LANES // 2
        while s > 0:
            for t in range(s):
                lanes[t] += lanes[t + s]
            s //= 2
        scale = np.float32(lanes[0] / length)
        scales[b] = scale

        # sweep 2 (in cache): error = c -/+ scale; byte q gathers the 8 sign bytes of word q
        # (element 8q + j is byte j: little-endian): the multiply moves bit 8j to bit 56 + j,
        # and no two of its terms land on the same bit, so the top byte is the packed signs
        if has_error:
            for i in range(length):
                e[i] = c_at[i] - (scale if positive[i] else -scale)
        for q in range(out.size):
            out[q] = (words[q] * np.uint64(0x0102040810204080)) >> np.uint64(56)


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    with _LOCK:
        _onebit_decompress(_np(bits), _np(scales), _np(out))


@_jit
def _onebit_decompress(bits, scales, out):
    n = out.size
    for b in prange(scales.size):
        start = b * BLOCK
        length = min(BLOCK, n - start)
        o = out[start : start + length]  # block-local views, as in _onebit_compress
        byte_of = bits[start // 8 : start // 8 + (length + 7) // 8]
        scale = scales[b]
        for i in range(length):
            o[i] = scale if (byte_of[i >> 3] >> (i & 7)) & 1 else -scale


# --- bf16 / fp16 -------------------------------------------------------------------------


def cast_compress(grad: torch.Tensor, error: torch.Tensor | None, values: torch.Tensor) -> None:
    err, has_error = _error(grad, error)
    with _LOCK:
        _cast_compress(_np(grad), err, has_error, values.dtype == torch.float16, _np(values))


@_jit
def _cast_compress(grad, error, has_error, to_fp16, values):
    n = grad.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        start = b * BLOCK
        length = min(BLOCK, n - start)
        g = grad[start : start + length]  # block-local views, as in _onebit_compress
        e = error[start : start + length]
        v = values[start : start + length]
        # the branches stay outside the element loops, so that LLVM vectorizes them
        if to_fp16:
            if has_error:
                for i in range(length):
                    c = g[i] + e[i]
                    e[i] = c
                    v[i] = _f32_to_f16(np.int64(np.float32(c).view(np.uint32)))
                for i in range(length):  # in cache; as one loop LLVM would not vectorize it
                    e[i] -= np.uint32(_f16_to_f32(np.int64(v[i]))).view(np.float32)
            else:
                for i in range(length):
                    v[i] = _f32_to_f16(np.int64(np.float32(g[i]).view(np.uint32)))
        elif has_error:
            for i in range(length):
                c = g[i] + e[i]
                h = _f32_to_bf16(np.int64(np.float32(c).view(np.uint32)))
                v[i] = h
                e[i] = c - np.uint32(_bf16_to_f32(h)).view(np.float32)
        else:
            for i in range(length):
                v[i] = _f32_to_bf16(np.int64(np.float32(g[i]).view(np.uint32)))


# --- top-k -------------------------------------------------------------------------------


def topk_compress(
    grad: torch.Tensor,
    error: torch.Tensor | None,
    k_full: int,
    k_last: int,
    indices: torch.Tensor,
    values: torch.Tensor,
) -> None:
    err, has_error = _error(grad, error)
    with _LOCK:
        _topk_compress(_np(grad), err, has_error, k_full, k_last, _np(indices), _np(values))


@_jit
def _topk_compress(grad, error, has_error, k_full, k_last, indices, values):
    n = grad.size
    blocks = (n + BLOCK - 1) // BLOCK
    for b in prange(blocks):
        start = b * BLOCK
        length = min(BLOCK, n - start)
        k = k_full if b < blocks - 1 else k_last
        g = grad[start : start + length]  # block-local views, as in _onebit_compress
        e = error[start : start + length]
        c_at = e if has_error else g
        kept_at = indices[b * k_full : b * k_full + k]
        kept = values[b * k_full : b * k_full + k]

        # sweep 1: c, and its key: the bits of |c|, which order as |c| does
        keys = np.empty(length, np.int32)
        for j in range(length):
            if has_error:
                e[j] = g[j] + e[j]
            keys[j] = np.int64(np.float32(c_at[j]).view(np.uint32)) & 0x7FFFFFFF
        threshold, equal_wanted = _kth_largest(keys, k)

        # sweep 2 (in cache): every key above the threshold, and the first equal_wanted equal
        # to it, in index order; error = c, 0 where kept
        out = 0
        for j in range(length):
            key = keys[j]
            if key > threshold or (key == threshold and equal_wanted > 0):
                if key == threshold:
                    equal_wanted -= 1
                kept_at[out] = start + j
                kept[out] = c_at[j]
                out += 1
                if has_error:
                    e[j] = 0.0


@numba.njit(nogil=True, cache=True)
def _kth_largest(keys, k):
    """(t, m): t is the k-th largest of keys (non-negative int32s), m how many of those equal
    to t are among the k largest. Radix select, a byte at a time from the top: count the
    candidates' digits, keep those in the digit where the k-th falls, and repeat on them."""
    # the first round (all keys) counts into 4 interleaved histograms: neighbours often share
    # a digit (the exponent), and counting them into one counter makes every increment wait
    # for the one before; the later rounds see few candidates
    interleaved = np.zeros((4, 256), np.int32)
    for j in range(keys.size):
        interleaved[j & 3, keys[j] >> 24] += 1
    histogram = interleaved[0] + interleaved[1] + interleaved[2] + interleaved[3]

    candidates = np.empty_like(keys)
    source = keys
    count = keys.size
    threshold = 0
    wanted = k  # how many of the candidates are still to be taken
    for shift in (24, 16, 8, 0):
        if shift != 24:
            histogram[:] = 0
            for j in range(count):
                histogram[(source[j] >> shift) & 255] += 1
        digit = 255
        while histogram[digit] < wanted:  # every candidate with a larger digit is taken
            wanted -= histogram[digit]
            digit -= 1
        threshold |= digit << shift
        kept = 0
        for j in range(count):  # in place after the first round: kept <= j
            if (source[j] >> shift) & 255 == digit:
                candidates[kept] = source[j]
                kept += 1
        count = kept
        source = candidates
    return threshold, wanted


def topk_decompress(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    """out (already zeroed) gets values at indices (checked to lie in range)."""
    with _LOCK:
        _topk_decompress(_np(indices), _np(values), _np(out))


@_jit
def _topk_decompress(indices, values, out):
    for i in prange(indices.size):
        out[indices[i]] = values[i]
