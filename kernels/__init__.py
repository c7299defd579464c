"""Fused gradient-compression kernels: 1-bit sign (with per-block scale), bf16/fp16 cast and
per-block top-k, each with optional error feedback, on CPU (Numba) and CUDA (Numba CUDA).

Every compress function takes a flat, contiguous, 1-D float32 `grad` (CPU or CUDA) and an
`error` buffer of the same shape, dtype and device, or None (no error feedback). With error
feedback the compressed value is c = grad + error (one fp32 add), and after the call
error == c - decompress(compressed), updated in place, so nothing is lost: it is sent later.
n = grad.numel() may be any size >= 1; elements are grouped in blocks of BLOCK (1024)
starting at element 0, and the last block may be partial (length L = n - (blocks-1)*BLOCK).

Formats (all little-endian; a push payload's byte layout is ps_offload.proto.payloads'):

onebit_compress(grad, error) -> (bits, scales)
    scales: float32[ceil(n / BLOCK)]; scale of block b = mean(|c|) over the block's elements
        (the L2-optimal scale for sign compression). The sum is taken in float64 in one fixed
        order on every backend (lane t = index-in-block mod 128 adds its 8 elements in index
        order, then the 128 lanes are added pairwise as a tree: lane t += lane t+s for
        s = 64, 32, ..., 1), divided by L and rounded to float32, so every backend gives the
        same bits.
    bits: uint8[ceil(n / 8)]; bit j of byte i (LSB first: (byte >> j) & 1) is element 8*i + j;
        1 means c >= 0 (decompresses to +scale; -0.0 counts as >= 0), 0 means c < 0 or NaN
        (-scale). The unused bits of the last byte are 0.
cast_compress(grad, error, dtype=torch.bfloat16 | torch.float16, *, out=None) -> values[n]
    of that dtype (into `out` when given). Round to nearest even, as torch's .to(dtype)
    (overflow to +-inf). A NaN stays a NaN, but its bits are not specified (torch's own CPU
    and CUDA conversions differ there). error becomes c - the rounded value, exactly.
topk_compress(grad, error, ratio) -> (indices: int32[K], values: float32[K])
    Each block keeps k_b = max(1, ceil(ratio * L_b)) elements (ceil of the float64 product;
    see topk_count), those of largest |c|, ties to the lower index (|c| is compared as the
    bits of |c|, so NaN ranks above infinity). Output is block-major, and within a block in
    ascending index order; indices are global (into the flat buffer), values are c there.
    error gets c with the kept elements set to 0. K = sum of k_b = topk_count(n, ratio).
    0 < ratio <= 1.

onebit_decompress(bits, scales, n, out=None), cast_decompress(values, out=None) and
topk_decompress(indices, values, n, out=None) give float32[n] (into `out` when given; top-k
leaves zeros elsewhere).

Backends: each entry point dispatches by device, CUDA tensors to Numba CUDA kernels (one
launch over the whole buffer, on torch's current stream, no copies) and CPU tensors to Numba
CPU kernels (parallel over blocks, one pass over memory). `backend="torch"` forces the plain
torch reference (kernels.reference), the oracle in tests; `backend="cpu"` or `"cuda"` force a
kernel (`"cuda"` accepts CPU tensors only under the CUDA simulator, NUMBA_ENABLE_CUDASIM=1).
cast_decompress is torch's widening copy on every backend (exact, and already one pass).
The first call of a kernel compiles it (seconds; CPU kernels are then cached on disk in
kernels/__pycache__), and CPU kernels run one at a time per process (each uses every core).

Bad input (wrong dtype, non-contiguous, not 1-D, size mismatch, device mismatch, overlapping
buffers, ratio out of range, top-k indices out of range) raises ValueError saying what to fix.

Beside the compression entry points here, the folder holds their backends and the daemon's
optimizer kernels:

    reference          the plain torch oracle of every compression kernel (backend="torch")
    cpu                the compression backend on the CPU: Numba kernels, parallel over blocks, one pass
    cuda               the compression backend on CUDA: Numba CUDA kernels, one launch on torch's stream
    rounding           the bit-level casts: fp32 <-> bf16 / fp16 on bit patterns, shared by both backends
    fused_step         the daemon's AdamW and SGD in one pass, bit for bit as torch's fused kernels;
                       all_finite, the non-finite check
    bf16_state_step    the daemon's AdamW over bf16 master, m and v in one pass (state_dtype="bfloat16")
    step_calibration   which of fused_step's forms this torch computes as, and its compiles off the
                       step's path
    fused_adamw        the daemon's fused 1-bit Adam step
    numba_cache        a Numba cache directory for all of them wherever the process runs
"""

from __future__ import annotations

import math

import torch

from ps_offload.kernels.numba_cache import ensure_numba_cache

ensure_numba_cache()  # before any kernel module compiles: they cache on disk

__all__ = [
    "BLOCK",
    "cast_compress",
    "cast_decompress",
    "onebit_compress",
    "onebit_decompress",
    "topk_compress",
    "topk_count",
    "topk_decompress",
]

BLOCK = 1024  # elements per block: one 1-bit scale per block; top-k picks per block
LANES = 128  # the fixed summation order of a block's scale (and threads per CUDA block)
ROWS = BLOCK // LANES

_BACKENDS = (None, "torch", "cpu", "cuda")
_CAST_DTYPES = (torch.bfloat16, torch.float16)


def onebit_compress(
    grad: torch.Tensor, error: torch.Tensor | None, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign bits (uint8[ceil(n/8)], LSB first) and per-block scales (float32[ceil(n/BLOCK)])
    of c = grad + error; error becomes c - decompressed. See the module docstring."""
    n = _check_grad_error(grad, error)
    impl = _impl(grad, backend)
    if impl is None:
        from ps_offload.kernels import reference

        return reference.onebit_compress(grad, error)
    bits = torch.empty(_cdiv(n, 8), dtype=torch.uint8, device=grad.device)
    scales = torch.empty(_cdiv(n, BLOCK), dtype=torch.float32, device=grad.device)
    impl.onebit_compress(grad, error, bits, scales)
    return bits, scales


def onebit_decompress(
    bits: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    out: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """float32[n]: +scale of the element's block where its bit is 1, -scale where it is 0."""
    n = _check_n(n)
    _check_flat("bits", bits, torch.uint8, _cdiv(n, 8))
    _check_flat("scales", scales, torch.float32, _cdiv(n, BLOCK), like=bits, like_name="bits")
    out = _out(out, n, bits)
    impl = _impl(bits, backend)
    if impl is None:
        from ps_offload.kernels import reference

        return out.copy_(reference.onebit_decompress(bits, scales, n))
    impl.onebit_decompress(bits, scales, out)
    return out


def cast_compress(
    grad: torch.Tensor,
    error: torch.Tensor | None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """c = grad + error rounded to bf16 or fp16 (nearest even); error becomes c - the rounded
    value. `out`: an optional preallocated dtype[n] (a fresh n-element tensor per call costs
    page faults on the CPU, about as much as the kernel)."""
    n = _check_grad_error(grad, error)
    if dtype not in _CAST_DTYPES:
        raise ValueError(f"cast_compress: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if out is None:
        out = torch.empty(n, dtype=dtype, device=grad.device)
    else:
        _check_flat("out", out, dtype, n, like=grad, like_name="grad")
        if _overlap(out, grad) or (error is not None and _overlap(out, error)):
            raise ValueError("out must not share memory with grad or error")
    impl = _impl(grad, backend)
    if impl is None:
        from ps_offload.kernels import reference

        return out.copy_(reference.cast_compress(grad, error, dtype))
    impl.cast_compress(grad, error, out)
    return out


def cast_decompress(
    values: torch.Tensor, out: torch.Tensor | None = None, *, backend: str | None = None
) -> torch.Tensor:
    """float32[n] of bf16 or fp16 values (exact). The same widening copy on every backend."""
    if not isinstance(values, torch.Tensor) or values.dtype not in _CAST_DTYPES:
        got = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"cast_decompress: values must be a torch.bfloat16 or torch.float16 tensor, got {got}")
    _check_flat("values", values, values.dtype, None)
    _impl(values, backend)  # validates the backend name against the device
    return _out(out, values.numel(), values).copy_(values)


def topk_count(n: int, ratio: float) -> int:
    """K, the number of elements topk_compress keeps from n: the sum over blocks of
    max(1, ceil(ratio * L_b)), L_b the block's length (ceil of the float64 product)."""
    n, ratio = _check_n(n), _check_ratio(ratio)
    k_full, k_last, blocks = _topk_plan(n, ratio)
    return k_full * (blocks - 1) + k_last


def topk_compress(
    grad: torch.Tensor, error: torch.Tensor | None, ratio: float, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, the k_b elements of largest |c| (ties: lower index), as global int32 indices
    and float32 values, block-major and ascending within a block; error becomes c with the
    kept elements zeroed."""
    n = _check_grad_error(grad, error)
    ratio = _check_ratio(ratio)
    impl = _impl(grad, backend)
    if impl is None:
        from ps_offload.kernels import reference

        return reference.topk_compress(grad, error, ratio)
    k_full, k_last, blocks = _topk_plan(n, ratio)
    total = k_full * (blocks - 1) + k_last
    indices = torch.empty(total, dtype=torch.int32, device=grad.device)
    values = torch.empty(total, dtype=torch.float32, device=grad.device)
    impl.topk_compress(grad, error, k_full, k_last, indices, values)
    return indices, values


def topk_decompress(
    indices: torch.Tensor,
    values: torch.Tensor,
    n: int,
    out: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """float32[n]: values at indices, zeros elsewhere. Indices must lie in [0, n)."""
    n = _check_n(n)
    _check_flat("indices", indices, torch.int32, None, allow_empty=True)
    _check_flat("values", values, torch.float32, indices.numel(), like=indices, like_name="indices", allow_empty=True)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= n):
        lo, hi = int(indices.min()), int(indices.max())
        raise ValueError(f"topk_decompress: indices must lie in [0, {n}), got values from {lo} to {hi}")
    out = _out(out, n, indices)
    impl = _impl(indices, backend)
    if impl is None:
        from ps_offload.kernels import reference

        return out.copy_(reference.topk_decompress(indices, values, n))
    out.zero_()
    if indices.numel():
        impl.topk_decompress(indices, values, out)
    return out


# --- validation and dispatch -------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _topk_plan(n: int, ratio: float) -> tuple[int, int, int]:
    """(k of a full block, k of the last block, number of blocks)."""
    blocks = _cdiv(n, BLOCK)
    last = n - (blocks - 1) * BLOCK
    return max(1, math.ceil(ratio * BLOCK)), max(1, math.ceil(ratio * last)), blocks


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1 (the number of fp32 elements), got {n!r}")
    return n


def _check_ratio(ratio: float) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"topk: ratio must be a number with 0 < ratio <= 1, got {ratio!r}")
    return float(ratio)


def _check_flat(
    name: str,
    t: torch.Tensor,
    dtype: torch.dtype,
    numel: int | None,
    *,
    like: torch.Tensor | None = None,
    like_name: str = "",
    allow_empty: bool = False,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (flatten it: .view(-1)), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got stride {t.stride()}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")
    if not allow_empty and t.numel() == 0:
        raise ValueError(f"{name} must not be empty")
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but {like_name} is on {like.device}; put both on one device")


def _check_grad_error(grad: torch.Tensor, error: torch.Tensor | None) -> int:
    _check_flat("grad", grad, torch.float32, None)
    if error is not None:
        _check_flat("error", error, torch.float32, grad.numel(), like=grad, like_name="grad")
        if _overlap(grad, error):
            raise ValueError("error must not share memory with grad (error feedback needs its own buffer)")
    return grad.numel()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _out(out: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(n, dtype=torch.float32, device=like.device)
    _check_flat("out", out, torch.float32, n, like=like, like_name="the compressed input")
    return out


def _impl(t: torch.Tensor, backend: str | None):
    """The kernel module for t's device (None: the torch reference)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    if backend is None:
        backend = "cuda" if t.is_cuda else "cpu"
    if backend == "cpu":
        if t.is_cuda:
            raise ValueError(f"backend='cpu' needs CPU tensors, got a tensor on {t.device}")
        from ps_offload.kernels import cpu

        return cpu
    if not t.is_cuda:
        import numba

        if not numba.config.ENABLE_CUDASIM:
            raise ValueError(
                f"backend='cuda' needs CUDA tensors, got a tensor on {t.device} "
                "(CPU tensors only under the CUDA simulator, NUMBA_ENABLE_CUDASIM=1)"
            )
    try:
        from ps_offload.kernels import cuda
    except ImportError as exc:  # numba-cuda is the `cuda` extra, not a base requirement
        raise ImportError(
            f"the CUDA compression kernels need Numba CUDA ({exc}): pip install 'ps-offload[cuda]'"
        ) from exc

    return cuda
