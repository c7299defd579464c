"""Numba CUDA kernels: one launch over the whole flat buffer, one thread block of LANES (128)
threads per BLOCK (1024) elements, on torch's current stream, on the tensors' own memory.

Thread t of a block handles elements r*LANES + t (r = 0..ROWS-1) when reading and writing
memory, so a warp's accesses are contiguous, and element 8t..8t+7 (from shared memory) when
building byte t of the sign bits or walking the block in index order. Everything is plain
per-thread code, shared memory and syncthreads (no warp intrinsics), so the same kernels run
under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import config, cuda

from ps_offload.kernels import BLOCK, LANES, ROWS, rounding

_SIM = bool(config.ENABLE_CUDASIM)
if not _SIM:
    # The first compile imports numba.cuda's numpy overloads; numba-cuda 0.30.4 (the newest as
    # of 2026-11) registers one for np.row_stack, which numpy 2.5 removed, so every kernel then
    # fails with an AttributeError deep in its compile (seen on the GPU image: numpy 2.5.2). Say
    # so at import, with the way out, instead.
    try:
        import numba.cuda.cudaimpl  # noqa: F401
    except AttributeError as exc:
        from importlib.metadata import version

        raise ImportError(
            f"numba-cuda {version('numba-cuda')} does not work with numpy {np.__version__} ({exc}); "
            "pip install 'numpy<2.5' (the `cuda` extra asks for it), or a numba-cuda that supports it"
        ) from exc

_f32_to_bf16 = cuda.jit(device=True)(rounding.f32_to_bf16)
_bf16_to_f32 = cuda.jit(device=True)(rounding.bf16_to_f32)
_f32_to_f16 = cuda.jit(device=True)(rounding.f32_to_f16)
_f16_to_f32 = cuda.jit(device=True)(rounding.f16_to_f32)


def _dev(t: torch.Tensor):
    """A Numba view of the tensor's memory (no copy); 2-byte floats as uint16. On a GPU, call
    it inside the tensor's device context: Numba ties the view to the current context."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.uint16)
    t = t.detach()
    return t.numpy() if _SIM else cuda.as_cuda_array(t, sync=False)


def _launch(kernel, blocks: int, like: torch.Tensor, *args) -> None:
    """kernel[blocks, LANES](*args) on like's device and torch's current stream there; tensor
    arguments are wrapped (_dev) in that device's context, so a tensor on cuda:1 is not taken
    for memory of the context current on the thread (cuda:0 by default)."""
    if _SIM:
        kernel[blocks, LANES](*_wrapped(args))
        return
    with cuda.gpus[like.device.index]:
        stream = cuda.external_stream(torch.cuda.current_stream(like.device).cuda_stream)
        kernel[blocks, LANES, stream](*_wrapped(args))


def _wrapped(args: tuple) -> list:
    return [_dev(a) if isinstance(a, torch.Tensor) else a for a in args]


def _error(grad: torch.Tensor, error: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """The error buffer to pass and whether it is one (the kernel ignores `grad` passed for it)."""
    return (grad, False) if error is None else (error, True)


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


# --- 1-bit -------------------------------------------------------------------------------


def onebit_compress(grad: torch.Tensor, error: torch.Tensor | None, bits: torch.Tensor, scales: torch.Tensor) -> None:
    err, has_error = _error(grad, error)
    n = grad.numel()
    _launch(_onebit_compress, _blocks(n), grad, grad, err, has_error, bits, scales, n)


@cuda.jit
def _onebit_compress(grad, error, has_error, bits, scales, n):
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    start = b * BLOCK
    length = min(BLOCK, n - start)
    c_block = cuda.shared.array(BLOCK, np.float32)
    lanes = cuda.shared.array(LANES, np.float64)

    # c, and lane t's sum of |c| over its elements r*LANES + t in order r (the fixed order)
    lane = np.float64(0.0)
    for r in range(ROWS):
        j = r * LANES + t
        c = np.float32(0.0)
        if j < length:
            c = grad[start + j]
            if has_error:
                c = c + error[start + j]
            lane += np.float64(abs(c))
        c_block[j] = c
    lanes[t] = lane
    cuda.syncthreads()
    s = LANES // 2
    while s > 0:  # lane t += lane t + s, s = 64 .. 1
        if t < s:
            lanes[t] += lanes[t + s]
        cuda.syncthreads()
        s //= 2
    scale = np.float32(lanes[0] / length)
    if t == 0:
        scales[b] = scale

    # byte t: elements 8t .. 8t+7, LSB first; absent ones stay 0
    if 8 * t < length:
        byte = 0
        for j in range(8):
            if 8 * t + j < length and c_block[8 * t + j] >= 0:
                byte |= 1 << j
        bits[start // 8 + t] = byte

    if has_error:
        for r in range(ROWS):
            j = r * LANES + t
            if j < length:
                c = c_block[j]
                error[start + j] = c - (scale if c >= 0 else -scale)


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    n = out.numel()
    _launch(_onebit_decompress, _blocks(n), bits, bits, scales, out, n)


@cuda.jit
def _onebit_decompress(bits, scales, out, n):
    b = cuda.blockIdx.x
    start = b * BLOCK
    scale = scales[b]
    for r in range(ROWS):
        i = start + r * LANES + cuda.threadIdx.x
        if i < n:
            out[i] = scale if (bits[i >> 3] >> (i & 7)) & 1 else -scale


# --- bf16 / fp16 -------------------------------------------------------------------------


def cast_compress(grad: torch.Tensor, error: torch.Tensor | None, values: torch.Tensor) -> None:
    err, has_error = _error(grad, error)
    n = grad.numel()
    to_fp16 = values.dtype == torch.float16
    _launch(_cast_compress, _blocks(n), grad, grad, err, has_error, to_fp16, values, n)


@cuda.jit
def _cast_compress(grad, error, has_error, to_fp16, values, n):
    for r in range(ROWS):
        i = cuda.blockIdx.x * BLOCK + r * LANES + cuda.threadIdx.x
        if i < n:
            c = grad[i]
            if has_error:
                c = c + error[i]
            u = np.int64(np.float32(c).view(np.uint32))
            h = _f32_to_f16(u) if to_fp16 else _f32_to_bf16(u)
            values[i] = h
            if has_error:
                w = _f16_to_f32(h) if to_fp16 else _bf16_to_f32(h)
                error[i] = c - np.uint32(w).view(np.float32)


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
    n = grad.numel()
    _launch(_topk_compress, _blocks(n), grad, grad, err, has_error, k_full, k_last, indices, values, n)


@cuda.jit
def _topk_compress(grad, error, has_error, k_full, k_last, indices, values, n):
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    start = b * BLOCK
    length = min(BLOCK, n - start)
    k = k_full if length == BLOCK else k_last  # (a full last block has k_last == k_full)
    c_block = cuda.shared.array(BLOCK, np.float32)
    keys = cuda.shared.array(BLOCK, np.int32)  # bits of |c| (ordered as |c|); -1: no element
    kept = cuda.shared.array(BLOCK, np.int32)
    histogram = cuda.shared.array(256, np.int32)
    counts = cuda.shared.array(LANES, np.int32)
    state = cuda.shared.array(2, np.int32)  # threshold so far, how many still wanted

    for r in range(ROWS):
        j = r * LANES + t
        key = -1
        if j < length:
            c = grad[start + j]
            if has_error:
                c = c + error[start + j]
            c_block[j] = c
            key = np.int64(np.float32(c).view(np.uint32)) & 0x7FFFFFFF
        keys[j] = key
    if t == 0:
        state[0] = 0
        state[1] = k
    cuda.syncthreads()

    # radix select, a byte at a time from the top: the k-th largest key is the threshold;
    # every larger key is kept, and the first (by index) state[1] keys equal to it
    mask = 0
    for p in range(4):
        shift = 24 - 8 * p
        histogram[t] = 0
        histogram[t + LANES] = 0
        cuda.syncthreads()
        prefix = np.int64(state[0])
        for j in range(8 * t, 8 * t + 8):
            key = np.int64(keys[j])
            if key >= 0 and (key & mask) == prefix:
                cuda.atomic.add(histogram, (key >> shift) & 255, 1)
        cuda.syncthreads()
        if t == 0:
            wanted = state[1]
            digit = 255
            while histogram[digit] < wanted:  # every key with a larger digit is kept
                wanted -= histogram[digit]
                digit -= 1
            state[0] = prefix | (digit << shift)
            state[1] = wanted
        cuda.syncthreads()
        mask |= 255 << shift
    threshold = np.int64(state[0])
    equal_wanted = np.int64(state[1])

    # how many keys equal to the threshold come before thread t's elements 8t..8t+7
    equal = 0
    for j in range(8 * t, 8 * t + 8):
        if np.int64(keys[j]) == threshold:
            equal += 1
    _exclusive_scan(counts, t, equal)
    equal_before = counts[t]
    cuda.syncthreads()

    # which of them are kept, and where they go (kept ones before them in index order)
    taken = 0
    for j in range(8 * t, 8 * t + 8):
        key = np.int64(keys[j])
        keep = 0
        if key > threshold:
            keep = 1
        elif key == threshold:
            if equal_before < equal_wanted:
                keep = 1
            equal_before += 1
        kept[j] = keep
        taken += keep
    _exclusive_scan(counts, t, taken)
    out = b * k_full + counts[t]
    for j in range(8 * t, 8 * t + 8):
        if kept[j]:
            indices[out] = start + j
            values[out] = c_block[j]
            out += 1

    if has_error:
        for r in range(ROWS):
            j = r * LANES + t
            if j < length:
                error[start + j] = np.float32(0.0) if kept[j] else c_block[j]


@cuda.jit(device=True)
def _exclusive_scan(counts, t, mine):
    """counts[t] = the sum of `mine` over threads 0..t-1 (thread 0 adds them up: 128 adds,
    simple and deterministic). Ends with the block synchronized."""
    counts[t] = mine
    cuda.syncthreads()
    if t == 0:
        total = 0
        for i in range(LANES):
            here = counts[i]
            counts[i] = total
            total += here
    cuda.syncthreads()


def topk_decompress(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    """out (already zeroed) gets values at indices (checked to lie in range)."""
    k = indices.numel()
    _launch(_topk_decompress, (k + LANES - 1) // LANES, indices, indices, values, out, k)


@cuda.jit
def _topk_decompress(indices, values, out, k):
    i = cuda.grid(1)
    if i < k:
        out[indices[i]] = values[i]
