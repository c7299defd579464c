"""The daemon's AdamW and SGD steps in one pass over memory (Numba CPU), bit for bit as torch's.

Before this, a BF16 gradient cost the daemon four passes over a shard: widen it into an fp32
buffer (read 2 bytes, write 4 per element), multiply it by the grad multiplier where there is
one (read 4, write 4), torch's fused AdamW (read 16, write 12) and, at the pull, round the
master to bf16 (read 4, write 2). Here one pass reads the gradient as it came (fp32, bf16 or
fp16) and p, m, v, and writes p, m, v: what torch's fused kernel alone moves on an fp32
gradient, or less.

[Note: why the bits are torch's] torch's fused CPU kernels (aten/src/ATen/native/cpu:
FusedAdamKernel.cpp, FusedSGDKernel.cpp) compute each element of a tensor's vectorized body
with the same fp32 operations whatever the vector width, and a scalar tail that rounds
differently. The daemon hands this kernel only runs whose elements torch puts in the body
(ps_proto/plan.py `kernel_runs`: whole 64-element blocks of a parameter), so repeating the
body's operations element by element gives its bits: each fp32 add, multiply, divide and
square root is correctly rounded wherever it runs. What differs between builds is where the
compiler fused a multiply and an add (one rounding instead of two): on torch 2.11-2.13 x86
builds the AdamW body is

    p *= 1 - lr*wd;  m = fma(1 - beta1, g - m, m);  v = fma((1 - beta2) * g, g, v * beta2)
    p += (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)

and SGD's `g = fma(p, wd, g)`, `buf = fma(g, 1 - dampening, buf * momentum)`, `g = fma(buf,
momentum, g)` (Nesterov), `p = fma(g, -lr, p)`; every constant is the double value rounded to
fp32, as torch's `Vectorized<float>(scalar_t(x))`. Numba emits no fused multiply-add of its
own (LLVM contracts none without fastmath), and `fma32` below is LLVM's exact one.
`matches_torch()` runs both on a probe at first use; on a build where they differ the daemon
keeps torch's kernels (ps_offload.daemon.model.optimizer), slower and never wrong.

The gradient is widened in registers (bf16: a shift; fp16: kernels/rounding.py, exact) and
multiplied by the step's grad multiplier as `torch.mul(grad, fp32 scalar)` would (one fp32
product). Parallel over tasks of TASK elements (prange); each task's element loop vectorizes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from functools import cache

import numba
import numpy as np
import torch
from numba import prange, types
from numba.core.extending import intrinsic

from ps_offload.kernels import rounding

TASK = 16384
"""Elements per parallel task: 64 KiB of each fp32 tensor, so a task's p, m, v and gradient sit
in L2 while it runs, and a 64 MiB shard is 1024 tasks for the cores to share."""

GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_JIT = dict(error_model="numpy", nogil=True, cache=True)
_bf16_to_f32 = numba.njit(inline="always")(rounding.bf16_to_f32)
_f16_to_f32 = numba.njit(inline="always")(rounding.f16_to_f32)
# Concurrent parallel launches abort under Numba's fallback threading layer (workqueue); each
# call already uses every core the daemon gives its optimizer.
LOCK = threading.Lock()


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c with one rounding (LLVM's llvm.fma.f32)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@numba.njit(inline="always", **_JIT)
def _widen(g, i, kind):
    if kind == 0:
        return np.float32(g[i])
    if kind == 1:
        return np.uint32(_bf16_to_f32(np.int64(g[i]))).view(np.float32)
    return np.uint32(_f16_to_f32(np.int64(g[i]))).view(np.float32)


@numba.njit(inline="always", **_JIT)
def _adamw_task(p, g, m, v, kind, mult, scaled, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step):
    for i in range(p.shape[0]):
        gi = _widen(g, i, kind)
        if scaled:
            gi = gi * mult
        pi = p[i] * wd_factor
        mi = m[i]
        if lerp_small:  # torch's lerp: |weight| < 0.5 from the start, else from the end
            mi = fma32(lerp, gi - mi, mi)
        else:
            mi = fma32(lerp, gi - mi, gi)
        vi = fma32(c2 * gi, gi, v[i] * b2)
        m[i] = mi
        v[i] = vi
        p[i] = pi + neg_step * mi / (np.sqrt(vi) / bc2_sqrt + eps)


@numba.njit(parallel=True, **_JIT)
def _adamw(starts, ends, p, g, m, v, kind, mult, scaled, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step):
    for t in prange(starts.shape[0]):
        s, e = starts[t], ends[t]
        # Task-local views (indices provably in range); the branches on `kind` and `scaled`
        # are the same for every element, so LLVM unswitches them and vectorizes each loop.
        _adamw_task(
            p[s:e], g[s:e], m[s:e], v[s:e], kind, mult, scaled, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt,
            eps, neg_step,
        )  # fmt: skip


@numba.njit(inline="always", **_JIT)
def _sgd_task(p, g, buf, kind, mult, scaled, wd, decay, momentum, damp, first, nesterov, neg_lr):
    for i in range(p.shape[0]):
        gi = _widen(g, i, kind)
        if scaled:
            gi = gi * mult
        if decay:
            gi = fma32(p[i], wd, gi)
        if momentum != 0:
            if first:
                bi = gi
            else:
                bi = fma32(gi, damp, buf[i] * momentum)
            buf[i] = bi
            gi = fma32(bi, momentum, gi) if nesterov else bi
        p[i] = fma32(gi, neg_lr, p[i])


@numba.njit(parallel=True, **_JIT)
def _sgd(starts, ends, p, g, buf, kind, mult, scaled, wd, decay, momentum, damp, first, nesterov, neg_lr):
    for t in prange(starts.shape[0]):
        s, e = starts[t], ends[t]
        _sgd_task(p[s:e], g[s:e], buf[s:e], kind, mult, scaled, wd, decay, momentum, damp, first, nesterov, neg_lr)


def tasks(runs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the parallel tasks covering `runs` ([start, end) element ranges of a
    shard), each at most TASK elements."""
    starts, ends = [], []
    for start, end in runs:
        for s in range(start, end, TASK):
            starts.append(s)
            ends.append(min(end, s + TASK))
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.uint16) if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def _f32(x: float) -> np.float32:
    return np.float32(x)


def adamw_(
    split: tuple[np.ndarray, np.ndarray],
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_multiplier: float | None = None,
) -> None:
    """One AdamW step, as torch._fused_adamw_ with `step` (the count after this update), over
    the tasks `split` (tasks(runs)) of the flat fp32 `param`, `exp_avg`, `exp_avg_sq` and the
    flat `grad` (fp32, bf16 or fp16) times `grad_multiplier`."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    weight = _f32(1 - beta1)
    small = abs(float(weight)) < 0.5
    lerp = weight if small else np.float32(weight - np.float32(1))  # torch: lerp_weight - Vec(1), in fp32
    starts, ends = split
    with LOCK:
        _adamw(
            starts, ends, _np(param), _np(grad), _np(exp_avg), _np(exp_avg_sq), GRAD_KINDS[grad.dtype],
            _f32(grad_multiplier or 1.0), grad_multiplier is not None, _f32(1 - lr * weight_decay), lerp, small,
            _f32(beta2), _f32(1 - beta2), _f32(math.sqrt(bias_correction2)), _f32(eps),
            _f32(-(lr / bias_correction1)),
        )  # fmt: skip


def sgd_(
    split: tuple[np.ndarray, np.ndarray],
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    first_step: bool,
    grad_multiplier: float | None = None,
) -> None:
    """One SGD step, as torch._fused_sgd_ (`first_step`: its is_first_step), over the tasks
    `split` of the flat fp32 `param` and `momentum_buffer` (None without momentum) and the flat
    `grad` (fp32, bf16 or fp16) times `grad_multiplier`."""
    starts, ends = split
    buf = _np(momentum_buffer) if momentum_buffer is not None else _np(param)  # never written without momentum
    with LOCK:
        _sgd(
            starts, ends, _np(param), _np(grad), buf, GRAD_KINDS[grad.dtype], _f32(grad_multiplier or 1.0),
            grad_multiplier is not None, _f32(weight_decay), weight_decay != 0.0, _f32(momentum),
            _f32(1 - dampening), first_step, nesterov, _f32(-lr),
        )  # fmt: skip


@cache
def matches_torch() -> bool:
    """Whether this machine's torch build computes its fused AdamW and SGD bodies as these
    kernels do (the note above): a probe of every path (gradient dtypes, multiplier, weight
    decay, lerp sides, momentum, Nesterov, first step) against torch._fused_adamw_ /
    _fused_sgd_, bit for bit."""
    g = torch.Generator().manual_seed(39)
    n = 4 * TASK + 64 * 3  # several tasks, whole 64-element blocks
    split = tasks([(0, n)])
    for dtype in GRAD_KINDS:
        grad = (torch.randn(n, generator=g) * 1e-2).to(dtype)
        wide = grad.float()
        for multiplier in (None, 0.375):
            scaled = wide if multiplier is None else wide * torch.tensor(multiplier, dtype=torch.float32)
            for beta1, decay in ((0.9, 0.01), (0.3, 0.0)):
                state = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g)]
                ours = [t.clone() for t in state]
                torch._fused_adamw_(
                    [state[0]], [scaled.clone()], [state[1]], [state[2]], [], [torch.tensor(3.0)], lr=1e-3,
                    beta1=beta1, beta2=0.999, weight_decay=decay, eps=1e-8, amsgrad=False, maximize=False,
                )  # fmt: skip
                adamw_(
                    split, ours[0], grad, ours[1], ours[2], step=3, lr=1e-3, beta1=beta1, beta2=0.999, eps=1e-8,
                    weight_decay=decay, grad_multiplier=multiplier,
                )  # fmt: skip
                if not all(torch.equal(a, b) for a, b in zip(state, ours, strict=True)):
                    return False
            for momentum, nesterov, first in ((0.0, False, True), (0.9, False, True), (0.9, True, False)):
                state = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2]
                ours = [t.clone() for t in state]
                torch._fused_sgd_(
                    [state[0]], [scaled.clone()], [state[1]] if momentum else [], weight_decay=0.01,
                    momentum=momentum, lr=0.05, dampening=0.0, nesterov=nesterov, maximize=False,
                    is_first_step=first,
                )  # fmt: skip
                sgd_(
                    split, ours[0], grad, ours[1] if momentum else None, lr=0.05, weight_decay=0.01,
                    momentum=momentum, dampening=0.0, nesterov=nesterov, first_step=first, grad_multiplier=multiplier,
                )  # fmt: skip
                if not all(torch.equal(a, b) for a, b in zip(state, ours, strict=True)):
                    return False
    return True
