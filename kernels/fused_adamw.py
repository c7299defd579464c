"""The daemon's fused 1-bit Adam step (Numba CPU): a MOMENTUM push in ONEBIT encoding.

In 1-bit Adam's compression stage (Tang et al., 2021; DeepSpeed's OnebitAdam) the trainer
keeps AdamW's first moment, compresses it to signs and a scale per 1024-element block with
error feedback, and replaces its own copy with the decompressed value; the second moment
stays as the uncompressed warm-up left it. The daemon's share is then, per element:

    m_i = +scale or -scale of its block, 0 where v_i == 0      (stored as exp_avg)
    u_i = clamp((m_i / bc1) / (sqrt(v_i) / sqrt(bc2) + eps), -R, R)
    p_i = p_i * (1 - lr * wd) - lr * u_i

with bc1 = 1 - beta1^t (t: updates including this one) and bc2 = 1 - beta2^t_frozen (v's
bias correction stays where v stopped, so the step size does not drift after the freeze).

Two guards that plain 1-bit Adam lacks, both for elements whose frozen v says little:
* v_i == 0: the element had no gradient in the whole warm-up (a dead unit, an unused
  embedding row) and has no preconditioner; it is not moved by the momentum (DeepSpeed asks
  the user for such a mask, `exp_avg_mask`). Signs cannot say "zero", so without this such
  an element would be stepped by scale / eps.
* The cap R = (1 - beta1) / sqrt((1 - beta2) (1 - beta1^2 / beta2)) is the largest |m / sqrt(v)|
  that exact Adam can reach (Cauchy-Schwarz over the two moving averages; 7.27 for betas
  (0.9, 0.999), 1.17 for (0.9, 0.95); no cap when beta1^2 >= beta2). A block's scale is
  the mean |m| of its 1024 elements, so an element with a tiny v (a unit that fired once in
  the warm-up) would otherwise be stepped by scale / sqrt(v), thousands of times further
  than Adam would move it; that diverged in tests. The cap never binds on a momentum that
  Adam itself could have produced with that v.
One pass over the shard: it reads p and v and 1/8 byte of signs and writes p and m, 16 bytes
per element, where torch's fused AdamW on an fp32 gradient reads p, m, v and g and writes
p, m and v, 28 bytes. No fp32 gradient or momentum is materialised beyond one block in L1.

The arithmetic is in fp32, decay first, then the step, so the same update written in plain
torch (`adam_frozen_variance_`) agrees within an ulp or two (the compiler may contract a
multiply-add); tests compare the two, and that one with the formula in float64.

Parallel over chunks of blocks (numba prange), so one call uses every core; callers that run
it from several threads serialize the calls (the daemon does: ps_offload.daemon.model.encodings.KERNEL_LOCK),
as Numba's fallback threading layer (workqueue) aborts on concurrent parallel launches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numba
import numpy as np
import torch

from ps_offload.kernels import BLOCK

# error_model="numpy": a float division by zero gives inf/nan as in C instead of raising, which
# also lets LLVM vectorize the loops (the Python model's zero check is a branch per element).
_JIT = dict(error_model="numpy", nogil=True)


@numba.njit(inline="always", **_JIT)
def _expand_signs(bits, scale, start, end, out):
    """out[: end - start] = +-scale from the sign bits of elements start..end (start % 8 == 0).
    64 at a time from a 64-bit word, so that every lane's bit mask is a constant and the
    selects vectorize (variable shifts per element were 2.5x slower); the rest one by one."""
    neg = -scale
    first = start >> 3
    words = (end - start) >> 6
    for k in range(words):
        word = np.uint64(0)
        for t in range(8):
            word |= np.uint64(bits[first + 8 * k + t]) << np.uint64(8 * t)
        for j in range(64):
            out[64 * k + j] = scale if (word >> np.uint64(j)) & np.uint64(1) else neg
    for i in range(64 * words, end - start):
        e = start + i
        out[i] = scale if (bits[e >> 3] >> (e & 7)) & 1 else neg


@numba.njit(inline="always", **_JIT)
def _step(p, m, v, momentum, decay, inv_bc1, bc2_sqrt, eps, cap, neg_lr):
    """m = momentum (0 where v == 0); u = clamp(m * inv_bc1 / (sqrt(v) / bc2_sqrt + eps), +-cap);
    p = p * decay + neg_lr * u, on equal-length slices."""
    for i in range(p.shape[0]):
        vi = v[i]
        mi = momentum[i] if vi > 0 else np.float32(0.0)
        m[i] = mi
        u = min(max(mi * inv_bc1 / (math.sqrt(vi) / bc2_sqrt + eps), -cap), cap)
        p[i] = p[i] * decay + neg_lr * u


@numba.njit(parallel=True, cache=True, **_JIT)
def _onebit_adam(p, m, v, bits, scales, seg_end, seg_decay, threads, inv_bc1, bc2_sqrt, eps, cap, neg_lr):
    """One 1-bit Adam step on p, m, v (fp32, n) from signs and per-block scales. seg_end: the
    int64 ends of the parameter pieces (ascending, the last = n); seg_decay: the fp32 factor
    1 - lr * wd of each; threads: numba's (passed in: reading it inside would keep the kernel
    out of the on-disk cache). Scalars are fp32 as torch casts them."""
    n = p.shape[0]
    nblocks = scales.shape[0]
    chunks = min(nblocks, 8 * threads)  # a few per thread, for balance
    per = (nblocks + chunks - 1) // chunks
    for c in numba.prange(chunks):
        block = np.empty(BLOCK, np.float32)  # one block's momentum, in L1
        for b in range(c * per, min(nblocks, (c + 1) * per)):
            base = b * BLOCK
            end = min(base + BLOCK, n)
            _expand_signs(bits, scales[b], base, end, block)
            s = np.searchsorted(seg_end, base, side="right")
            start = base
            while start < end:  # the parameter pieces in this block
                stop = min(end, seg_end[s])
                _step(
                    p[start:stop], m[start:stop], v[start:stop], block[start - base : stop - base],
                    seg_decay[s], inv_bc1, bc2_sqrt, eps, cap, neg_lr,
                )  # fmt: skip
                start = stop
                s += 1


def onebit_adam_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    bits: torch.Tensor,
    scales: torch.Tensor,
    *,
    segments: Sequence[tuple[int, int, float]],
    step: int,
    variance_frozen_at: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """1-bit Adam's update of `param` (the fp32 master of one shard, n elements) from the
    trainer's momentum given as signs `bits` (uint8, ceil(n/8), LSB first) and block scales
    `scales` (fp32, ceil(n/BLOCK)): `exp_avg` becomes the decompressed momentum, `exp_avg_sq`
    is read only. `step`: updates including this one (t of bc1); `variance_frozen_at`: the
    updates after which exp_avg_sq stopped (t of bc2). `segments`: (start, end, weight_decay)
    per parameter piece, tiling [0, n) in order. Raises ValueError on mismatched inputs."""
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
    _check_steps(step, variance_frozen_at)
    # Scalars formed in double, then cast to fp32 where used (as torch's CPU AdamW does).
    f32 = np.float32
    _onebit_adam(
        param.numpy(),
        exp_avg.numpy(),
        exp_avg_sq.numpy(),
        bits.numpy(),
        scales.numpy(),
        np.array(ends, dtype=np.int64),
        np.array([1 - lr * wd for _, _, wd in segments], dtype=np.float32),
        numba.get_num_threads(),
        f32(1 / (1 - beta1**step)),
        f32(math.sqrt(1 - beta2**variance_frozen_at)),
        f32(eps),
        f32(step_cap(beta1, beta2)),
        f32(-lr),
    )


def _check_steps(step: int, variance_frozen_at: int) -> None:
    if not 1 <= variance_frozen_at <= step:
        raise ValueError(f"need 1 <= variance_frozen_at <= step, got {variance_frozen_at} and {step}")


def step_cap(beta1: float, beta2: float) -> float:
    """R, the largest |m / sqrt(v)| exact Adam can reach with these betas (inf if unbounded)."""
    if beta1 * beta1 >= beta2:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


def adam_frozen_variance_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    momentum: torch.Tensor,
    *,
    segments: Sequence[tuple[int, int, float]],
    step: int,
    variance_frozen_at: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """The same update in plain torch, from an fp32 `momentum` (a MOMENTUM push that is not
    ONEBIT, once decompressed); also the oracle the fused kernel is tested against."""
    _check_steps(step, variance_frozen_at)
    exp_avg.copy_(momentum).masked_fill_(exp_avg_sq == 0, 0.0)
    inv_bc1 = 1 / (1 - beta1**step)
    bc2_sqrt = math.sqrt(1 - beta2**variance_frozen_at)
    cap = step_cap(beta1, beta2)
    for start, end, wd in segments:
        p, m, v = param[start:end], exp_avg[start:end], exp_avg_sq[start:end]
        u = (m * inv_bc1).div_(v.sqrt().div_(bc2_sqrt).add_(eps)).clamp_(-cap, cap)
        p.mul_(1 - lr * wd).add_(u, alpha=-lr)
