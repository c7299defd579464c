"""The daemon's AdamW and SGD steps in one pass over memory (Numba CPU), bit for bit as torch's.

Before this, a BF16 gradient cost the daemon four passes over a shard: widen it into an fp32
buffer (read 2 bytes, write 4 per element), multiply it by the grad multiplier where there is
one (read 4, write 4), torch's fused AdamW (read 16, write 12) and, at the pull, round the
master to bf16 (read 4, write 2). Here one pass reads the gradient as it came (fp32, bf16 or
fp16) and p, m, v, and writes p, m, v: what torch's fused kernel alone moves on an fp32
gradient, or less.

[Note: why the bits are torch's] torch's fused CPU kernels (aten/src/ATen/native/cpu:
FusedAdamKernel.cpp, FusedSGDKernel.cpp) step each tensor in a vectorized body, `vector`
elements at a time, and its last numel % vector elements in a scalar tail; its threads split
a tensor at multiples of 16 elements, so the tail is only ever a parameter's last elements.
Every fp32 add, multiply, divide and square root is correctly rounded wherever it runs, so
repeating each loop's operations element by element gives its bits; what differs between
builds is where the compiler fused a multiply and an add (one rounding instead of two), and
it does so differently in the body and in the tail. On torch 2.11-2.13 x86 builds the AdamW
body is

    p *= 1 - lr*wd;  m = fma(1 - beta1, g - m, m);  v = fma((1 - beta2) * g, g, v * beta2)
    p += (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)

with v = fma(v, beta2, (1 - beta2) * g * g) in the tail, and SGD's body `g = fma(p, wd, g)`,
`buf = fma(g, 1 - dampening, buf * momentum)`, `g = fma(buf, momentum, g)` (Nesterov),
`p = fma(g, -lr, p)`; every constant is the double value rounded to fp32, as torch's
`Vectorized<float>(scalar_t(x))`. Numba emits no fused multiply-add of its own (LLVM
contracts none without fastmath), and `fma32` below is LLVM's exact one.
kernels/step_calibration.py finds the vector width and the tail's forms by running both on a
probe, once per process, and on a build where no form matches the daemon keeps torch's
kernels (ps_offload.daemon.model.optimizer), slower and never wrong.

A shard's pieces of parameters come as (start, end, tail_from) ranges (`tasks`): where a
shard cut falls inside a parameter changes nothing, the element's place in its parameter
alone decides body or tail, as in torch.optim's call on the whole parameter.

The gradient is widened in registers (bf16: a shift; fp16: the CPU's conversion, HARDWARE_HALF,
or kernels/rounding.py; exact) and
multiplied by the step's grad multiplier as `torch.mul(grad, fp32 scalar)` would (one fp32
product). Parallel over tasks of TASK elements (prange); each task's element loop vectorizes.
One kernel per gradient dtype, one compiled form each (an out, or its stand-in, always of the
gradient's dtype): seconds to compile from cold, so kernels/step_calibration.py compiles a
daemon's off its pushes' path.
"""

from __future__ import annotations

import math
import platform
import threading
from collections.abc import Callable, Sequence

import numba
import numpy as np
import torch
from llvmlite import binding, ir
from numba import prange, types
from numba.core.extending import intrinsic

from ps_offload.kernels import rounding

TASK = 16384
"""Elements per parallel task: 64 KiB of each fp32 tensor, so a task's p, m, v and gradient sit
in L2 while it runs, and a 64 MiB shard is 1024 tasks for the cores to share."""

GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
JIT = dict(error_model="numpy", nogil=True, cache=True)
_f16_to_f32 = numba.njit(inline="always")(rounding.f16_to_f32)
_f32_to_f16 = numba.njit(inline="always")(rounding.f32_to_f16)
# Where the new parameters go as well (the pull a push carries), as `out_kind`: 0 none, 1 fp32,
# 2 bf16, 3 fp16 (rounded as `Tensor.to` rounds); a kernel emits in its gradient's dtype, kind + 1.
_NO_OUT = {torch.float32: np.zeros(1, dtype=np.float32), torch.bfloat16: np.zeros(1, dtype=np.uint16),
           torch.float16: np.zeros(1, dtype=np.uint16)}  # fmt: skip
# Concurrent parallel launches abort under Numba's fallback threading layer (workqueue); each
# call already uses every core the daemon gives its optimizer.
LOCK = threading.Lock()
_threads = 0  # set_threads; 0: Numba's own count


def set_threads(count: int) -> None:
    """The threads every kernel here runs on from now on (the daemon's store.optimizer_threads),
    at most Numba's NUMBA_NUM_THREADS."""
    global _threads
    _threads = max(1, min(count, numba.config.NUMBA_NUM_THREADS))


def launch(kernel, *args):
    with LOCK:
        if _threads:  # (per launching thread in Numba: the pushes' threads vary)
            numba.set_num_threads(_threads)
        return kernel(*args)


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c with one rounding (LLVM's llvm.fma.f32)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


# The CPU converts fp16 itself (x86's F16C, every AVX2 part; arm64): LLVM's fpext / fptrunc
# then become one vector instruction, where kernels/rounding.py's forms take a dozen and halve
# the vector width. Every non-NaN value converts exactly as the integer forms do (tests: every
# fp16 pattern), and a NaN's payload as in torch's vectorized conversions (the integer forms
# give 0x7E00). Elsewhere LLVM would call a runtime helper Numba does not link: those stay.
HARDWARE_HALF = platform.machine().lower() in ("aarch64", "arm64") or bool(
    binding.get_host_cpu_features().get("f16c", False)
)


@intrinsic
def _half_to_f32(typingctx, bits):
    """The fp16 with bits `bits` (uint16) as float32: exact."""

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_half(typingctx, x):
    """fp16 bits of float32 `x`, rounded to nearest even (the current rounding mode)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@numba.njit(inline="always", **JIT)
def _widen(g, i, kind):
    if kind == 0:
        return np.float32(g[i])
    if kind == 1:  # in 32-bit lanes (kernels/rounding.py's int64 forms halve the vector width)
        return np.uint32(np.uint32(g[i]) << np.uint32(16)).view(np.float32)
    if HARDWARE_HALF:
        return _half_to_f32(np.uint16(g[i]))
    return np.uint32(_f16_to_f32(np.int64(g[i]))).view(np.float32)


@numba.njit(inline="always", **JIT)
def to_bf16(x):
    """bf16 bits of x, round to nearest even (kernels/rounding.py f32_to_bf16, in 32-bit lanes)."""
    u = np.float32(x).view(np.uint32)
    rounded = np.uint32(np.uint32(u + np.uint32(0x7FFF) + (np.uint32(u >> np.uint32(16)) & np.uint32(1))) >> 16)
    nan = np.uint32(u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = np.uint32(np.uint32(u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    return np.uint16(quiet if nan else rounded)


@numba.njit(inline="always", **JIT)
def _emit(out, i, x, out_kind):
    """out[i] = x in the dtype `out_kind` names (above), rounded to nearest even."""
    if out_kind == 1:
        out[i] = x
    elif out_kind == 2:
        out[i] = to_bf16(x)
    elif out_kind == 3 and HARDWARE_HALF:
        out[i] = _f32_to_half(np.float32(x))
    elif out_kind == 3:
        out[i] = np.uint16(_f32_to_f16(np.int64(np.float32(x).view(np.uint32))))


@numba.njit(inline="always", **JIT)
def adamw_element(pi, gi, mi, vi, tail, tail_v, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step):
    """One element's AdamW step, as torch's vectorized body (tail False) or its scalar tail
    computes it; returns (p, m, v)."""
    pi = pi * wd_factor
    base = mi if lerp_small else gi  # torch's lerp: |weight| < 0.5 from the start, else from the end
    mi = fma32(lerp, gi - mi, base)
    if not tail or tail_v == 0:
        vi = fma32(c2 * gi, gi, vi * b2)
    elif tail_v == 1:
        vi = fma32(vi, b2, c2 * gi * gi)
    else:
        vi = vi * b2 + c2 * gi * gi
    return pi + neg_step * mi / (np.sqrt(vi) / bc2_sqrt + eps), mi, vi


@numba.njit(inline="always", **JIT)
def _adamw_loop(p, g, m, v, out, kind, out_kind, mult, a):
    wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step = a
    for i in range(p.shape[0]):
        gi = _widen(g, i, kind) * mult  # (times 1 without a multiplier: exact)
        pi, m[i], v[i] = adamw_element(
            p[i], gi, m[i], v[i], False, 0, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step
        )
        p[i] = pi
        _emit(out, i, pi, out_kind)


@numba.njit(inline="always", **JIT)
def _adamw_tasks(tasks, p, g, m, v, out, kind, emit, mult, tail_v, a):
    """The tasks of one step for a gradient of `kind`, the new values also into `out` in the
    gradient's dtype when `emit`. `kind` is a constant in each caller below, and the loop is
    unswitched by hand on `emit`: every loop is branch-free and vectorizes."""
    out_kind = kind + 1 if emit else 0
    wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step = a
    for t in prange(tasks.shape[0]):
        s, e, tail_from = tasks[t, 0], tasks[t, 1], tasks[t, 2]
        body_end = min(e, max(s, tail_from))
        o = out[s:e] if emit else out  # (no out: a one-element stand-in, never written)
        # Task-local views: their indices are provably in range.
        if emit:
            _adamw_loop(p[s:body_end], g[s:body_end], m[s:body_end], v[s:body_end], o, kind, kind + 1, mult, a)
        else:
            _adamw_loop(p[s:body_end], g[s:body_end], m[s:body_end], v[s:body_end], o, kind, 0, mult, a)
        for i in range(body_end, e):  # a parameter's last elements: torch's scalar tail
            gi = _widen(g, i, kind) * mult
            pi, m[i], v[i] = adamw_element(
                p[i], gi, m[i], v[i], True, tail_v, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step
            )
            p[i] = pi
            _emit(o, i - s, pi, out_kind)


# One kernel per gradient dtype, each compiled at its first use (and cached on disk): a daemon
# compiles the one its trainers' model needs.
@numba.njit(parallel=True, **JIT)
def _adamw_f32(tasks, p, g, m, v, out, emit, mult, tail_v, a):
    _adamw_tasks(tasks, p, g, m, v, out, 0, emit, mult, tail_v, a)


@numba.njit(parallel=True, **JIT)
def _adamw_bf16(tasks, p, g, m, v, out, emit, mult, tail_v, a):
    _adamw_tasks(tasks, p, g, m, v, out, 1, emit, mult, tail_v, a)


@numba.njit(parallel=True, **JIT)
def _adamw_f16(tasks, p, g, m, v, out, emit, mult, tail_v, a):
    _adamw_tasks(tasks, p, g, m, v, out, 2, emit, mult, tail_v, a)


_ADAMW = (_adamw_f32, _adamw_bf16, _adamw_f16)


@numba.njit(inline="always", **JIT)
def _sgd_element(pi, gi, bi, tail, variant, wd, decay, momentum, damp, first, nesterov, neg_lr):
    """One element's SGD step, as torch's body (tail False) or its scalar tail (`variant`:
    SGD_TAIL's fields) computes it; returns (p, buf)."""
    if decay:
        gi = fma32(pi, wd, gi) if not tail or variant[0] else gi + pi * wd
    if momentum != 0:
        if first:
            bi = gi
        elif not tail or variant[1] == 2:
            bi = fma32(gi, damp, bi * momentum)
        elif variant[1] == 1:
            bi = fma32(bi, momentum, gi * damp)
        else:
            bi = bi * momentum + gi * damp
        if nesterov:
            gi = fma32(bi, momentum, gi) if not tail or variant[2] else gi + bi * momentum
        else:
            gi = bi
    if not tail or variant[3]:
        return fma32(gi, neg_lr, pi), bi
    return pi - gi * -neg_lr, bi


@numba.njit(inline="always", **JIT)
def _sgd_loop(p, g, buf, out, kind, out_kind, has_momentum, mult, a):
    # `has_momentum` is a constant in each caller: a store under a condition inside the loop
    # kept LLVM from vectorizing the loop that also emits (about 3x slower, by hand).
    wd, decay, momentum, damp, first, nesterov, neg_lr = a
    momentum = momentum if has_momentum else np.float32(0)  # (a constant the element's branch folds on)
    for i in range(p.shape[0]):
        gi = _widen(g, i, kind) * mult
        pi, bi = _sgd_element(p[i], gi, buf[i], False, (1, 2, 1, 1), wd, decay, momentum, damp, first, nesterov,
                              neg_lr)  # fmt: skip
        p[i] = pi
        if has_momentum:  # (without momentum `buf` is `p` itself: not written)
            buf[i] = bi
        _emit(out, i, pi, out_kind)


@numba.njit(inline="always", **JIT)
def _sgd_tasks(tasks, p, g, buf, out, kind, emit, mult, variant, a):
    """As _adamw_tasks."""
    out_kind = kind + 1 if emit else 0
    wd, decay, momentum, damp, first, nesterov, neg_lr = a
    for t in prange(tasks.shape[0]):
        s, e, tail_from = tasks[t, 0], tasks[t, 1], tasks[t, 2]
        body_end = min(e, max(s, tail_from))
        o = out[s:e] if emit else out
        if emit and momentum != 0:
            _sgd_loop(p[s:body_end], g[s:body_end], buf[s:body_end], o, kind, kind + 1, True, mult, a)
        elif emit:
            _sgd_loop(p[s:body_end], g[s:body_end], buf[s:body_end], o, kind, kind + 1, False, mult, a)
        elif momentum != 0:
            _sgd_loop(p[s:body_end], g[s:body_end], buf[s:body_end], o, kind, 0, True, mult, a)
        else:
            _sgd_loop(p[s:body_end], g[s:body_end], buf[s:body_end], o, kind, 0, False, mult, a)
        for i in range(body_end, e):
            gi = _widen(g, i, kind) * mult
            pi, bi = _sgd_element(p[i], gi, buf[i], True, variant, wd, decay, momentum, damp, first, nesterov,
                                  neg_lr)  # fmt: skip
            p[i] = pi
            if momentum != 0:
                buf[i] = bi
            _emit(o, i - s, pi, out_kind)


@numba.njit(parallel=True, **JIT)
def _sgd_f32(tasks, p, g, buf, out, emit, mult, variant, a):
    _sgd_tasks(tasks, p, g, buf, out, 0, emit, mult, variant, a)


@numba.njit(parallel=True, **JIT)
def _sgd_bf16(tasks, p, g, buf, out, emit, mult, variant, a):
    _sgd_tasks(tasks, p, g, buf, out, 1, emit, mult, variant, a)


@numba.njit(parallel=True, **JIT)
def _sgd_f16(tasks, p, g, buf, out, emit, mult, variant, a):
    _sgd_tasks(tasks, p, g, buf, out, 2, emit, mult, variant, a)


_SGD = (_sgd_f32, _sgd_bf16, _sgd_f16)


@numba.njit(inline="always", **JIT)
def _exponent_carries(words, exponent, carry):
    # Per lane, (bits & exponent) + carry sets the lane's top bit exactly when every exponent
    # bit is set (the lane's top bit is clear after the mask and the sum never leaves the lane),
    # so an OR of 64-bit words holds the answer for 4 (or 2) lanes at a time: 3 cheap ops per
    # load. (A max of 16-bit lanes, the check before, read about half as fast on one core.)
    seen = np.uint64(0)
    for i in range(words.shape[0]):
        seen |= (words[i] & exponent) + carry
    return seen


@numba.njit(parallel=True, **JIT)
def _carries(words, exponent, carry, seen):
    n = seen.shape[0]
    for t in prange(n):
        seen[t] = _exponent_carries(words[t * TASK : min(words.shape[0], (t + 1) * TASK)], exponent, carry)


# A value is a NaN or an infinity when its exponent bits are all set: (bits view, its exponent
# bits, the lowest of them, the sign bit) per dtype, each repeated across a 64-bit word below.
_INFINITY = {torch.float32: (torch.uint32, 0x7F800000, 0x00800000, 0x80000000),
             torch.bfloat16: (torch.uint16, 0x7F80, 0x0080, 0x8000),
             torch.float16: (torch.uint16, 0x7C00, 0x0400, 0x8000)}  # fmt: skip


def _repeat(lane: int, bits: int) -> np.uint64:
    return np.uint64(sum(lane << shift for shift in range(0, 64, bits)))


def all_finite(values: torch.Tensor) -> bool:
    """Whether no element of the flat fp32, bf16 or fp16 `values` is a NaN or an infinity:
    their bits, all cores, one read at memory speed (the daemon's non-finite check). The
    elements before the first 8-byte boundary and after the last are checked apart."""
    kind, exponent, lowest, sign = _INFINITY[values.dtype]
    bits = values.view(kind).numpy()
    size = bits.itemsize
    head = min(bits.shape[0], (-bits.ctypes.data % 8) // size)
    body_end = head + (bits.shape[0] - head) // (8 // size) * (8 // size)
    edges = np.concatenate([bits[:head], bits[body_end:]])
    if edges.size and bool(((edges & exponent) == exponent).any()):
        return False
    if body_end == head:
        return True
    words = bits[head:body_end].view(np.uint64)
    seen = np.zeros(-(-words.shape[0] // TASK), dtype=np.uint64)
    lanes = 8 * size
    launch(_carries, words, _repeat(exponent, lanes), _repeat(lowest, lanes), seen)
    return not int(np.bitwise_or.reduce(seen)) & int(_repeat(sign, lanes))


def tasks(pieces: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """The parallel tasks covering `pieces` ((start, end, tail_from): a parameter's elements
    [start, end) of a shard, those from tail_from on in torch's scalar tail), each at most
    TASK elements: an int64 array of (start, end, tail_from) rows."""
    rows = [(s, min(end, s + TASK), tail_from) for start, end, tail_from in pieces for s in range(start, end, TASK)]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.uint16) if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def _f32(x: float) -> np.float32:
    return np.float32(x)


def _multiplier(grad_multiplier: float | None) -> np.float32:
    return _f32(1.0 if grad_multiplier is None else grad_multiplier)  # (times 1: exact)


def _emits(out: torch.Tensor | None, grad: torch.Tensor) -> bool:
    """Whether the kernel writes `out` itself: each kernel emits in its gradient's dtype (the
    model's), the case the trainer's pull asks for; another dtype is a copy after the pass."""
    return out is not None and out.dtype == grad.dtype


def _out(out: torch.Tensor | None, grad: torch.Tensor, emit: bool) -> np.ndarray:
    # Without an out, a one-element stand-in of the dtype an out would have: one compiled
    # form per kernel, whether it emits or not.
    return _np(out) if emit else _NO_OUT[grad.dtype]


def _copy_out(out: torch.Tensor | None, param: torch.Tensor, emitted: bool) -> None:
    if out is not None and not emitted:
        out.copy_(param)  # (Tensor.copy_ rounds to nearest even, as _emit does)


def adamw_constants(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> tuple:
    """The fp32 constants adamw_element takes for one step, as torch's kernel rounds them."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    weight = _f32(1 - beta1)
    small = bool(abs(float(weight)) < 0.5)
    lerp = weight if small else np.float32(weight - np.float32(1))  # torch: lerp_weight - Vec(1), in fp32
    return (_f32(1 - lr * weight_decay), lerp, small, _f32(beta2), _f32(1 - beta2),
            _f32(math.sqrt(bias_correction2)), _f32(eps), _f32(-(lr / bias_correction1)))  # fmt: skip


def _adamw_call(split, param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, multiplier,
                tail, out):  # fmt: skip
    """adamw_'s kernel and its arguments."""
    constants = adamw_constants(step, lr, beta1, beta2, eps, weight_decay)
    emit = _emits(out, grad)
    args = (split, _np(param), _np(grad), _np(exp_avg), _np(exp_avg_sq), _out(out, grad, emit), emit,
            _multiplier(multiplier), int(tail), constants)  # fmt: skip
    return _ADAMW[GRAD_KINDS[grad.dtype]], args, emit


def _sgd_call(split, param, grad, momentum_buffer, lr, weight_decay, momentum, dampening, nesterov, first_step,
              multiplier, tail, out):  # fmt: skip
    """sgd_'s kernel and its arguments."""
    buf = _np(momentum_buffer) if momentum_buffer is not None else _np(param)  # never written without momentum
    constants = (_f32(weight_decay), weight_decay != 0.0, _f32(momentum), _f32(1 - dampening), bool(first_step),
                 bool(nesterov), _f32(-lr))  # fmt: skip
    emit = _emits(out, grad)
    args = (split, _np(param), _np(grad), buf, _out(out, grad, emit), emit, _multiplier(multiplier),
            tuple(int(t) for t in tail), constants)  # fmt: skip
    return _SGD[GRAD_KINDS[grad.dtype]], args, emit


def adamw_(
    split: np.ndarray,
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
    tail: int,
    grad_multiplier: float | None = None,
    out: torch.Tensor | None = None,
) -> None:
    """One AdamW step, as torch._fused_adamw_ with `step` (the count after this update), over
    the tasks `split` (`tasks`) of the flat fp32 `param`, `exp_avg`, `exp_avg_sq` and the flat
    `grad` (fp32, bf16 or fp16) times `grad_multiplier`. `tail`: the tail's form (this
    machine's: kernels/step_calibration.py). `out`: a flat tensor as long as `param` (fp32,
    bf16 or fp16) that gets the new values too, as `param.to(out.dtype)` would be, in the same
    pass when it has the gradient's dtype."""
    kernel, args, emit = _adamw_call(split, param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
                                     weight_decay, grad_multiplier, tail, out)  # fmt: skip
    launch(kernel, *args)
    _copy_out(out, param, emit)


def sgd_(
    split: np.ndarray,
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
    tail: tuple[int, int, int, int],
    grad_multiplier: float | None = None,
    out: torch.Tensor | None = None,
) -> None:
    """One SGD step, as torch._fused_sgd_ (`first_step`: its is_first_step), over the tasks
    `split` of the flat fp32 `param` and `momentum_buffer` (None without momentum) and the flat
    `grad` (fp32, bf16 or fp16) times `grad_multiplier`. `tail`, `out`: as adamw_'s."""
    kernel, args, emit = _sgd_call(split, param, grad, momentum_buffer, lr, weight_decay, momentum, dampening,
                                   nesterov, first_step, grad_multiplier, tail, out)  # fmt: skip
    launch(kernel, *args)
    _copy_out(out, param, emit)


def compiled(optimizer: str, grad_dtype: torch.dtype) -> tuple[Callable[[], None], bool]:
    """Whether `optimizer`'s ("adamw" or "sgd") kernel for gradients of `grad_dtype` is compiled
    (or loaded from Numba's cache) in this process, and the call that compiles it, without
    running it (seconds on a cold cache: kernels/step_calibration.py does it off the step's
    path). The arguments' types are those every call gives it (flat contiguous arrays; an out
    or its stand-in of the gradient's dtype)."""
    empty = torch.empty(0)
    split = tasks([])
    grad = torch.empty(0, dtype=grad_dtype)
    if optimizer == "adamw":
        kernel, args, _ = _adamw_call(split, empty, grad, empty, empty, 1, 1.0, 0.9, 0.999, 1e-8, 0.0, None, 0, None)
    else:
        kernel, args, _ = _sgd_call(split, empty, grad, None, 1.0, 0.0, 0.0, 0.0, False, True, None, (1, 1, 1, 1),
                                    None)  # fmt: skip
    signature = tuple(numba.typeof(a) for a in args)
    return (lambda: kernel.compile(signature)), signature in kernel.overloads
