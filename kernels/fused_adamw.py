"""The daemon's fused 1-bit decompress + AdamW step (Numba CPU).

A ONEBIT gradient push (proto/ps.proto: one fp32 scale per 1024-element block, then one sign
bit per element) is applied in one pass over the shard: each block reads its scale and its
128 bytes of signs, and updates m, v and the fp32 master in place. No fp32 gradient is
materialised, so the step streams 12 bytes per element in and 12 out plus 1/8 byte of
signs, where decompressing first and then running torch's fused AdamW streams 4 + 16 in and
12 out (and writes the 4-byte gradient once more when decompressing).

The arithmetic is torch's (`aten/src/ATen/native/cpu/FusedAdamKernel.cpp`, AdamW mode), in
fp32 with the same double-precision scalars: decoupled decay p *= 1 - lr * wd;
m = lerp(m, g, 1 - beta1); v = beta2 * v + (1 - beta2) * g * g;
p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps). torch's binary rounds
some of these through fused multiply-adds (its compiler contracts them): the lerp, and the
second moment as fma((1 - beta2) g, g, beta2 v) in its vector loop but
fma(v, beta2, (1 - beta2) g g) in the scalar tail, the last len % lanes elements of each
parameter. This kernel rounds the same way, taking the lane count from torch's CPU
capability, and matches torch on the decompressed gradient bit for bit on the machines
tested. That is an observation about a build, not a contract (another compiler or CPU may
round otherwise), so tests compare within a few fp32 ulps.

Weight decay is per parameter: `segments` gives each parameter piece of the shard (start,
end, weight_decay), as `ps_daemon.optim.ShardOptimizer` groups them for torch.

Parallel over chunks of blocks (numba prange), so one call uses every core; callers that run
it from several threads serialize the calls (the daemon does: ps_daemon.encodings.KERNEL_LOCK),
as Numba's fallback threading layer (workqueue) aborts on concurrent parallel launches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

from kernels import BLOCK


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c rounded once (LLVM's llvm.fma; one instruction on x86-64 with FMA3)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


# error_model="numpy": a float division by zero gives inf/nan as in C instead of raising, which
# also lets LLVM vectorize the loops (the Python model's zero check is a branch per element).
_JIT = dict(error_model="numpy", nogil=True)


@numba.njit(inline="always", **_JIT)
def _expand_signs(bits, g_abs, start, end, out):
    """out[: end - start] = +-g_abs from the sign bits of elements start..end (start % 8 == 0).
    64 at a time from a 64-bit word, so that every lane's bit mask is a constant and the
    selects vectorize (variable shifts per element were 2.5x slower); the rest one by one."""
    neg = -g_abs
    first = start >> 3
    words = (end - start) >> 6
    for k in range(words):
        word = np.uint64(0)
        for t in range(8):
            word |= np.uint64(bits[first + 8 * k + t]) << np.uint64(8 * t)
        for j in range(64):
            out[64 * k + j] = g_abs if (word >> np.uint64(j)) & np.uint64(1) else neg
    for i in range(64 * words, end - start):
        e = start + i
        out[i] = g_abs if (bits[e >> 3] >> (e & 7)) & 1 else neg


@numba.njit(inline="always", **_JIT)
def _adamw(p, m, v, g, decay, w, beta2, c2, neg_step, bc2_sqrt, eps, lerp_small, fused_v):
    """AdamW on equal-length slices p, m, v with gradient g. `lerp_small` and `fused_v` are
    literals at every call, so each combination compiles to its own vector loop.
    lerp(m, g, w) as torch: m + w (g - m) for |w| < 0.5, else g - (1 - w)(g - m). `fused_v`:
    the second moment rounded as torch's vector loop rounds it, else as its scalar tail."""
    a = w if lerp_small else w - np.float32(1.0)
    for i in range(p.shape[0]):
        gi = g[i]
        mi = _fma(a, gi - m[i], m[i] if lerp_small else gi)
        vi = _fma(c2 * gi, gi, v[i] * beta2) if fused_v else _fma(v[i], beta2, c2 * gi * gi)
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * decay + neg_step * mi / (math.sqrt(vi) / bc2_sqrt + eps)


@numba.njit(inline="always", **_JIT)
def _adamw_piece(p, m, v, g, decay, w, beta2, c2, neg_step, bc2_sqrt, eps, lerp_small, fused_v):
    if lerp_small:
        _adamw(p, m, v, g, decay, w, beta2, c2, neg_step, bc2_sqrt, eps, True, fused_v)
    else:
        _adamw(p, m, v, g, decay, w, beta2, c2, neg_step, bc2_sqrt, eps, False, fused_v)


@numba.njit(parallel=True, cache=True, **_JIT)
def _onebit_adamw(
    p, m, v, bits, scales, seg_end, seg_decay, lanes, threads, lerp_small, w, beta2, c2, neg_step, bc2_sqrt, eps
):
    """One AdamW step on p, m, v (fp32, n) from 1-bit signs and per-block scales.

    seg_end: int64 ends of the parameter pieces (ascending, the last = n); seg_decay: the
    fp32 factor 1 - lr * wd of each; lanes: torch's vector width (the last len % lanes
    elements of each piece take its scalar tail); threads: numba's (passed in, as a call
    through its ctypes pointer here would keep the kernel out of the on-disk cache).
    Scalars are fp32 as torch casts them."""
    n = p.shape[0]
    nblocks = scales.shape[0]
    chunks = min(nblocks, 8 * threads)  # a few per thread, for balance
    per = (nblocks + chunks - 1) // chunks
    for c in numba.prange(chunks):
        g = np.empty(BLOCK, np.float32)  # one block's gradient, in L1; never the whole shard's
        for b in range(c * per, min(nblocks, (c + 1) * per)):
            base = b * BLOCK
            end = min(base + BLOCK, n)
            _expand_signs(bits, scales[b], base, end, g)
            s = np.searchsorted(seg_end, base, side="right")
            start = base
            while start < end:  # the parameter pieces in this block
                piece_start = seg_end[s - 1] if s > 0 else 0
                stop = min(end, seg_end[s])
                tail = max(start, min(stop, seg_end[s] - (seg_end[s] - piece_start) % lanes))
                decay = seg_decay[s]
                _adamw_piece(
                    p[start:tail], m[start:tail], v[start:tail], g[start - base : tail - base],
                    decay, w, beta2, c2, neg_step, bc2_sqrt, eps, lerp_small, True,
                )  # fmt: skip
                _adamw_piece(
                    p[tail:stop], m[tail:stop], v[tail:stop], g[tail - base : stop - base],
                    decay, w, beta2, c2, neg_step, bc2_sqrt, eps, lerp_small, False,
                )  # fmt: skip
                start = stop
                s += 1


def onebit_adamw_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    bits: torch.Tensor,
    scales: torch.Tensor,
    *,
    segments: Sequence[tuple[int, int, float]],
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """AdamW on `param` (the fp32 master of one shard, n elements) with the gradient given as
    1-bit signs `bits` (uint8, ceil(n/8)) and block scales `scales` (fp32, ceil(n/BLOCK)),
    updating `exp_avg` and `exp_avg_sq` in place. `step` is the step count after this update
    (torch's state_step, already incremented). `segments`: (start, end, weight_decay) per
    parameter piece, tiling [0, n) in order. Raises ValueError on mismatched inputs."""
    n = param.numel()
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D float32 CPU tensor, got {t.dtype} {tuple(t.shape)}")
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, param has {n}")
    if bits.dtype != torch.uint8 or bits.numel() != (n + 7) // 8 or not bits.is_contiguous() or bits.is_cuda:
        raise ValueError(
            f"bits must be {(n + 7) // 8} contiguous uint8 on the CPU for {n} elements, got {bits.dtype} {bits.numel()}"
        )
    nblocks = (n + BLOCK - 1) // BLOCK
    if scales.dtype != torch.float32 or scales.numel() != nblocks or not scales.is_contiguous() or scales.is_cuda:
        raise ValueError(
            f"scales must be {nblocks} contiguous float32 on the CPU for {n} elements, "
            f"got {scales.dtype} {scales.numel()}"
        )
    starts = [start for start, _, _ in segments]
    ends = [end for _, end, _ in segments]
    if not segments or starts[0] != 0 or ends[-1] != n or starts[1:] != ends[:-1]:
        raise ValueError(f"segments must tile [0, {n}) in order, got {[(s, e) for s, e, _ in segments]}")
    if step < 1:
        raise ValueError(f"step counts updates including this one and must be >= 1, got {step}")
    # Scalars as torch's CPU kernel forms them: in double, then cast to fp32 where used.
    f32 = np.float32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    decay = np.array([1 - lr * wd for _, _, wd in segments], dtype=np.float32)
    w = 1 - beta1
    _onebit_adamw(
        param.numpy(),
        exp_avg.numpy(),
        exp_avg_sq.numpy(),
        bits.numpy(),
        scales.numpy(),
        np.array(ends, dtype=np.int64),
        decay,
        _torch_lanes(),
        numba.get_num_threads(),
        abs(f32(w)) < f32(0.5),
        f32(w),
        f32(beta2),
        f32(1 - beta2),
        f32(-(lr / bias_correction1)),
        f32(math.sqrt(bias_correction2)),
        f32(eps),
    )


def _torch_lanes() -> int:
    """fp32 lanes of torch's CPU vector loops (its scalar tails are the last len % lanes)."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
