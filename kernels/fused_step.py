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
contracts none without fastmath), and `fma32` below is LLVM's exact one. `calibration()`
finds the vector width and the tail's forms by running both on a probe at first use, and on
a build where no form matches the daemon keeps torch's kernels
(ps_offload.daemon.model.optimizer), slower and never wrong.

A shard's pieces of parameters come as (start, end, tail_from) ranges (`tasks`): where a
shard cut falls inside a parameter changes nothing, the element's place in its parameter
alone decides body or tail, as in torch.optim's call on the whole parameter.

The gradient is widened in registers (bf16: a shift; fp16: kernels/rounding.py, exact) and
multiplied by the step's grad multiplier as `torch.mul(grad, fp32 scalar)` would (one fp32
product). Parallel over tasks of TASK elements (prange); each task's element loop vectorizes.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
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
_f32_to_bf16 = numba.njit(inline="always")(rounding.f32_to_bf16)
_f32_to_f16 = numba.njit(inline="always")(rounding.f32_to_f16)
OUT_KINDS = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
"""Where the new parameters go as well, in which dtype (the pull a push carries with it): none,
fp32, or rounded to bf16 / fp16 as `Tensor.to` rounds."""
_NO_OUT = np.zeros(1, dtype=np.float32)
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
def _emit(out, i, x, out_kind):
    """out[i] = x in the out's dtype (OUT_KINDS), rounded to nearest even."""
    if out_kind == 1:
        out[i] = x
    elif out_kind == 2:
        out[i] = np.uint16(_f32_to_bf16(np.int64(np.float32(x).view(np.uint32))))
    elif out_kind == 3:
        out[i] = np.uint16(_f32_to_f16(np.int64(np.float32(x).view(np.uint32))))


@numba.njit(inline="always", **_JIT)
def _adamw_element(pi, gi, mi, vi, tail, tail_v, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step):
    """One element's AdamW step, as torch's vectorized body (tail False) or its scalar tail
    computes it; returns (p, m, v)."""
    pi = pi * wd_factor
    if lerp_small:  # torch's lerp: |weight| < 0.5 from the start, else from the end
        mi = fma32(lerp, gi - mi, mi)
    else:
        mi = fma32(lerp, gi - mi, gi)
    if not tail or tail_v == 0:
        vi = fma32(c2 * gi, gi, vi * b2)
    elif tail_v == 1:
        vi = fma32(vi, b2, c2 * gi * gi)
    else:
        vi = vi * b2 + c2 * gi * gi
    return pi + neg_step * mi / (np.sqrt(vi) / bc2_sqrt + eps), mi, vi


@numba.njit(inline="always", **_JIT)
def _adamw_body(p, g, m, v, out, kind, mult, scaled, out_kind, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps,
                neg_step):  # fmt: skip
    for i in range(p.shape[0]):
        gi = _widen(g, i, kind)
        if scaled:
            gi = gi * mult
        pi, m[i], v[i] = _adamw_element(
            p[i], gi, m[i], v[i], False, 0, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step
        )
        p[i] = pi
        _emit(out, i, pi, out_kind)


@numba.njit(parallel=True, **_JIT)
def _adamw(tasks, p, g, m, v, out, kind, mult, scaled, tail_v, out_kind, wd_factor, lerp, lerp_small, b2, c2,
           bc2_sqrt, eps, neg_step):  # fmt: skip
    for t in prange(tasks.shape[0]):
        s, e, tail_from = tasks[t, 0], tasks[t, 1], tasks[t, 2]
        body_end = min(e, max(s, tail_from))
        o = out[s:e] if out_kind else out  # (no out: a one-element stand-in, never written)
        # Task-local views (indices provably in range); the branches on `kind`, `scaled` and
        # `out_kind` are the same for every element, so LLVM unswitches them and vectorizes.
        _adamw_body(
            p[s:body_end], g[s:body_end], m[s:body_end], v[s:body_end], o, kind, mult, scaled, out_kind, wd_factor,
            lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step,
        )  # fmt: skip
        for i in range(body_end, e):  # a parameter's last elements: torch's scalar tail
            gi = _widen(g, i, kind)
            if scaled:
                gi = gi * mult
            pi, m[i], v[i] = _adamw_element(
                p[i], gi, m[i], v[i], True, tail_v, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step
            )
            p[i] = pi
            _emit(o, i - s, pi, out_kind)


@numba.njit(inline="always", **_JIT)
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


@numba.njit(inline="always", **_JIT)
def _sgd_body(p, g, buf, out, kind, mult, scaled, out_kind, wd, decay, momentum, damp, first, nesterov, neg_lr):
    for i in range(p.shape[0]):
        gi = _widen(g, i, kind)
        if scaled:
            gi = gi * mult
        pi, bi = _sgd_element(p[i], gi, buf[i], False, (1, 2, 1, 1), wd, decay, momentum, damp, first, nesterov,
                              neg_lr)  # fmt: skip
        p[i] = pi
        if momentum != 0:  # (without momentum `buf` is `p` itself: not written)
            buf[i] = bi
        _emit(out, i, pi, out_kind)


@numba.njit(parallel=True, **_JIT)
def _sgd(tasks, p, g, buf, out, kind, mult, scaled, variant, out_kind, wd, decay, momentum, damp, first, nesterov,
         neg_lr):  # fmt: skip
    for t in prange(tasks.shape[0]):
        s, e, tail_from = tasks[t, 0], tasks[t, 1], tasks[t, 2]
        body_end = min(e, max(s, tail_from))
        o = out[s:e] if out_kind else out
        _sgd_body(p[s:body_end], g[s:body_end], buf[s:body_end], o, kind, mult, scaled, out_kind, wd, decay,
                  momentum, damp, first, nesterov, neg_lr)  # fmt: skip
        for i in range(body_end, e):
            gi = _widen(g, i, kind)
            if scaled:
                gi = gi * mult
            pi, bi = _sgd_element(p[i], gi, buf[i], True, variant, wd, decay, momentum, damp, first, nesterov,
                                  neg_lr)  # fmt: skip
            p[i] = pi
            if momentum != 0:
                buf[i] = bi
            _emit(o, i - s, pi, out_kind)


@numba.njit(inline="always", **_JIT)
def _count_nonfinite(bits, exponent):
    bad = 0
    for i in range(bits.shape[0]):
        bad += (bits[i] & exponent) == exponent
    return bad


@numba.njit(parallel=True, **_JIT)
def _nonfinite(bits, exponent):
    n = bits.shape[0]
    bad = 0
    for t in prange((n + TASK - 1) // TASK):
        bad += _count_nonfinite(bits[t * TASK : min(n, (t + 1) * TASK)], exponent)
    return bad


_EXPONENT = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80),
             torch.float16: (torch.int16, 0x7C00)}  # fmt: skip


def all_finite(values: torch.Tensor) -> bool:
    """Whether no element of the flat fp32, bf16 or fp16 `values` is a NaN or an infinity:
    its exponent bits, all cores, one read at memory speed (the daemon's non-finite check)."""
    kind, exponent = _EXPONENT[values.dtype]
    bits = values.view(kind).numpy()
    with LOCK:
        return _nonfinite(bits, bits.dtype.type(exponent)) == 0


def tasks(pieces: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """The parallel tasks covering `pieces` ((start, end, tail_from): a parameter's elements
    [start, end) of a shard, those from tail_from on in torch's scalar tail), each at most
    TASK elements: an int64 array of (start, end, tail_from) rows."""
    rows = [(s, min(end, s + TASK), tail_from) for start, end, tail_from in pieces for s in range(start, end, TASK)]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def _tail(given, field: str):
    if given is not None:
        return given
    found = calibration()
    if found is None:
        raise RuntimeError("this torch build's fused kernels compute otherwise than these (calibration() is None)")
    return getattr(found, field)


def _out(out: torch.Tensor | None) -> np.ndarray:
    return _NO_OUT if out is None else _np(out)


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.uint16) if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def _f32(x: float) -> np.float32:
    return np.float32(x)


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
    grad_multiplier: float | None = None,
    tail: int | None = None,
    out: torch.Tensor | None = None,
) -> None:
    """One AdamW step, as torch._fused_adamw_ with `step` (the count after this update), over
    the tasks `split` (`tasks`) of the flat fp32 `param`, `exp_avg`, `exp_avg_sq` and the flat
    `grad` (fp32, bf16 or fp16) times `grad_multiplier`. `tail`: the tail's form (Calibration;
    default this machine's). `out`: a flat tensor as long as `param` (fp32, bf16 or fp16) that
    gets the new values too, as `param.to(out.dtype)` would be, in the same pass."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    weight = _f32(1 - beta1)
    small = abs(float(weight)) < 0.5
    lerp = weight if small else np.float32(weight - np.float32(1))  # torch: lerp_weight - Vec(1), in fp32
    with LOCK:
        _adamw(
            split, _np(param), _np(grad), _np(exp_avg), _np(exp_avg_sq), _out(out), GRAD_KINDS[grad.dtype],
            _f32(grad_multiplier or 1.0), grad_multiplier is not None, _tail(tail, "adamw_tail"),
            OUT_KINDS[None if out is None else out.dtype],
            _f32(1 - lr * weight_decay), lerp, small, _f32(beta2), _f32(1 - beta2),
            _f32(math.sqrt(bias_correction2)), _f32(eps), _f32(-(lr / bias_correction1)),
        )  # fmt: skip


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
    grad_multiplier: float | None = None,
    tail: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> None:
    """One SGD step, as torch._fused_sgd_ (`first_step`: its is_first_step), over the tasks
    `split` of the flat fp32 `param` and `momentum_buffer` (None without momentum) and the flat
    `grad` (fp32, bf16 or fp16) times `grad_multiplier`. `tail`, `out`: as adamw_'s."""
    buf = _np(momentum_buffer) if momentum_buffer is not None else _np(param)  # never written without momentum
    with LOCK:
        _sgd(
            split, _np(param), _np(grad), buf, _out(out), GRAD_KINDS[grad.dtype], _f32(grad_multiplier or 1.0),
            grad_multiplier is not None, _tail(tail, "sgd_tail"), OUT_KINDS[None if out is None else out.dtype],
            _f32(weight_decay), weight_decay != 0.0, _f32(momentum), _f32(1 - dampening), first_step, nesterov,
            _f32(-lr),
        )  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """How this machine's torch build computes its fused AdamW and SGD (the note above):
    `vector`, the elements of its vectorized body's step (a tensor's last numel % vector
    elements are its scalar tail); `adamw_tail`, the tail's form of v's update (0: the body's,
    1: fma(v, beta2, (1 - beta2) * g * g), 2: no fused multiply-add); `sgd_tail`, the tail's
    forms (weight decay fused or not; the momentum buffer as in the body (2), fma(buf,
    momentum, g * (1 - dampening)) (1) or unfused (0); Nesterov's add fused or not; the
    parameter's update fused or not)."""

    vector: int
    adamw_tail: int
    sgd_tail: tuple[int, int, int, int]


ADAMW_TAILS = (0, 1, 2)
SGD_TAILS = tuple(itertools.product((1, 0), (2, 1, 0), (1, 0), (1, 0)))
VECTORS = (16, 8)


@cache
def calibration() -> Calibration | None:
    """What this machine's torch computes (Calibration), found by running its fused AdamW and
    SGD on a probe (many short tensors, so that most elements fall in a scalar tail, and a few
    long ones; every gradient dtype, with and without a multiplier, weight decay, both sides of
    the lerp, momentum, dampening, Nesterov, the first step; values over five orders of
    magnitude) and keeping the first form of this kernel that gives the same bits everywhere;
    None where none does (the daemon then keeps torch's kernels)."""
    probe = _Probe()
    adamw = next(((v, t) for v in VECTORS for t in ADAMW_TAILS if probe.adamw_matches(v, t)), None)
    sgd = next(((v, t) for v in VECTORS for t in SGD_TAILS if probe.sgd_matches(v, t)), None)
    if adamw is None or sgd is None or adamw[0] != sgd[0]:
        return None
    return Calibration(vector=adamw[0], adamw_tail=adamw[1], sgd_tail=sgd[1])


class _Probe:
    """The probe's tensors, and torch's results on them, computed once."""

    SHORT, COUNT = 31, 300  # 31 = 16 + 15 = 24 + 7: a body and a tail at either vector width
    LONG = (3 * TASK + 64 * 5 + 13, 64 * 7)

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(39)
        self.lengths = [self.SHORT] * self.COUNT + list(self.LONG)
        n = sum(self.lengths)

        def spread(scale: float) -> torch.Tensor:  # values over five orders of magnitude
            return (torch.rand(n, generator=g) - 0.5) * scale * 10.0 ** torch.randint(-4, 1, (n,), generator=g).float()

        self.params, self.moments = spread(4.0), spread(0.02)
        self.squares = spread(1e-3).abs()
        self.grads = {dtype: spread(0.5).to(dtype) for dtype in GRAD_KINDS}
        self.cases = []  # (kind, settings, torch's state after the step)
        for dtype, grad in self.grads.items():
            for multiplier in (None, 0.375):
                wide = grad.float() if multiplier is None else grad.float() * torch.tensor(multiplier)
                for beta1, decay in ((0.9, 0.01), (0.3, 0.0)):
                    settings = dict(beta1=beta1, weight_decay=decay, multiplier=multiplier, dtype=dtype)
                    self.cases.append(("adamw", settings, self._torch_adamw(wide, beta1, decay)))
                for momentum, dampening, nesterov, first in (
                    (0.0, 0.0, False, True), (0.9, 0.1, False, True), (0.9, 0.1, False, False), (0.9, 0.0, True, False),
                ):  # fmt: skip
                    settings = dict(momentum=momentum, dampening=dampening, nesterov=nesterov, first=first,
                                    multiplier=multiplier, dtype=dtype)  # fmt: skip
                    self.cases.append(("sgd", settings, self._torch_sgd(wide, momentum, dampening, nesterov, first)))

    def _split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(tensor, self.lengths))

    def _torch_adamw(self, grad: torch.Tensor, beta1: float, decay: float) -> list[torch.Tensor]:
        state = [self.params.clone(), self.moments.clone(), self.squares.clone()]
        views = [self._split(t) for t in state]
        torch._fused_adamw_(
            views[0], self._split(grad.clone()), views[1], views[2], [], [torch.tensor(3.0)] * len(self.lengths),
            lr=2e-3, beta1=beta1, beta2=0.999, weight_decay=decay, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
        return state

    def _torch_sgd(self, grad, momentum, dampening, nesterov, first) -> list[torch.Tensor]:
        state = [self.params.clone(), self.moments.clone()]
        torch._fused_sgd_(
            self._split(state[0]), self._split(grad.clone()), self._split(state[1]) if momentum else [],
            weight_decay=0.01, momentum=momentum, lr=0.05, dampening=dampening, nesterov=nesterov, maximize=False,
            is_first_step=first,
        )  # fmt: skip
        return state

    def _tasks(self, vector: int) -> np.ndarray:
        pieces, start = [], 0
        for length in self.lengths:
            pieces.append((start, start + length, start + length - length % vector))
            start += length
        return tasks(pieces)

    def adamw_matches(self, vector: int, tail: int) -> bool:
        split = self._tasks(vector)
        for kind, settings, expected in self.cases:
            if kind != "adamw":
                continue
            ours = [self.params.clone(), self.moments.clone(), self.squares.clone()]
            adamw_(
                split, ours[0], self.grads[settings["dtype"]], ours[1], ours[2], step=3, lr=2e-3,
                beta1=settings["beta1"], beta2=0.999, eps=1e-8, weight_decay=settings["weight_decay"],
                grad_multiplier=settings["multiplier"], tail=tail,
            )  # fmt: skip
            if not all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True)):
                return False
        return True

    def sgd_matches(self, vector: int, tail: tuple[int, int, int, int]) -> bool:
        split = self._tasks(vector)
        for kind, settings, expected in self.cases:
            if kind != "sgd":
                continue
            ours = [self.params.clone(), self.moments.clone()]
            sgd_(
                split, ours[0], self.grads[settings["dtype"]], ours[1] if settings["momentum"] else None, lr=0.05,
                weight_decay=0.01, momentum=settings["momentum"], dampening=settings["dampening"],
                nesterov=settings["nesterov"], first_step=settings["first"], grad_multiplier=settings["multiplier"],
                tail=tail,
            )  # fmt: skip
            if not all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True)):
                return False
        return True
