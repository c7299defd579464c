"""AdamW over bf16 master values and state in one pass (Numba CPU), bit for bit as torch's fused
kernel on bf16 tensors: the daemon's step for OffloadConfig(state_dtype="bfloat16").

Why not torch's kernel: on the daemon's cores it is bound by its conversions, not by memory
(bench daemon_update_bf16_state: 14 bytes an element at about half the rate kernels/fused_step.py
moves fp32 state), and the pull a push carries is then a second pass over the master.

[Note: why the bits are torch's] torch's fused AdamW on bf16 tensors widens each element to
fp32 (exact), computes the fp32 update, and rounds p, m and v back to bf16 (nearest even); the
new p comes from the unrounded m and v. Its arithmetic is the fp32 kernel's, body and tail
alike (kernels/fused_step.py's note, the same forms step_calibration finds), and its body
steps Vectorized<BFloat16>, twice the lanes of Vectorized<float> in the same registers: the
tail is a parameter's last numel % (2 * vector) elements. Measured on torch 2.13 (AVX-512
host, fp32 vector 8): elements whose fused and unfused v differ in bf16 land in the tail's
form exactly from n - n % 16 on (tests/kernels/test_bf16_state_step.py places them at every
position). step_calibration also checks this kernel on a probe before the daemon uses it.

The gradient is the bf16 `param.grad` torch would hold: as it came, or times the grad
multiplier in fp32 and rounded to bf16, as GradScaler's unscale_ writes it (times 1: exact).
The new master is also written into `out` (bf16: the pull the push carries) in the pass.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from ps_offload.kernels.fused_step import JIT, adamw_constants, adamw_element, launch, to_bf16

VECTOR_FACTOR = 2
"""Lanes of torch's Vectorized<BFloat16> per lane of its Vectorized<float> (the note above)."""


@numba.njit(inline="always", **JIT)
def _wide(bits):
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@numba.njit(inline="always", **JIT)
def _element(p, g, m, v, out, i, out_i, emit, scaled, mult, tail, tail_v, a):
    wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps, neg_step = a
    # Without a multiplier the rounding is the identity (times 1: exact), and skipping it
    # shortened this arithmetic-bound pass by about a fifth (by hand; bench daemon_update_bf16_state).
    gi = _wide(to_bf16(_wide(g[i]) * mult)) if scaled else _wide(g[i])
    pi, mi, vi = adamw_element(
        _wide(p[i]), gi, _wide(m[i]), _wide(v[i]), tail, tail_v, wd_factor, lerp, lerp_small, b2, c2, bc2_sqrt, eps,
        neg_step,
    )  # fmt: skip
    bits = to_bf16(pi)
    p[i], m[i], v[i] = bits, to_bf16(mi), to_bf16(vi)
    if emit:
        out[out_i] = bits


@numba.njit(inline="always", **JIT)
def _body(p, g, m, v, out, emit, scaled, mult, tail_v, a):
    for i in range(p.shape[0]):
        _element(p, g, m, v, out, i, i, emit, scaled, mult, False, tail_v, a)


@numba.njit(parallel=True, **JIT)
def _adamw_bf16_state(tasks, p, g, m, v, out, emit, mult, tail_v, a):
    """Every array is bf16 bits (uint16); `out` a one-element stand-in without `emit`."""
    scaled = mult != np.float32(1)
    for t in prange(tasks.shape[0]):
        s, e, tail_from = tasks[t, 0], tasks[t, 1], tasks[t, 2]
        body_end = min(e, max(s, tail_from))
        o = out[s:e] if emit else out
        # Unswitched by hand on `emit` and `scaled`, so that each loop is branch-free and vectorizes.
        if emit and scaled:
            _body(p[s:body_end], g[s:body_end], m[s:body_end], v[s:body_end], o, True, True, mult, tail_v, a)
        elif emit:
            _body(p[s:body_end], g[s:body_end], m[s:body_end], v[s:body_end], o, True, False, mult, tail_v, a)
        elif scaled:
            _body(p[s:body_end], g[s:body_end], m[s:body_end], v[s:body_end], o, False, True, mult, tail_v, a)
        else:
            _body(p[s:body_end], g[s:body_end], m[s:body_end], v[s:body_end], o, False, False, mult, tail_v, a)
        for i in range(body_end, e):  # a parameter's last elements: torch's scalar tail
            _element(p, g, m, v, o, i, i - s, emit, scaled, mult, True, tail_v, a)


_NO_OUT = np.zeros(1, dtype=np.uint16)


def _bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.bfloat16:
        raise TypeError(f"bf16 state steps bf16 tensors, got {t.dtype}")
    return t.view(torch.uint16).numpy()


def _call(split, param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, multiplier, tail, out):
    emit = out is not None and out.dtype == torch.bfloat16
    mult = np.float32(1.0 if multiplier is None else multiplier)
    args = (split, _bits(param), _bits(grad), _bits(exp_avg), _bits(exp_avg_sq), _bits(out) if emit else _NO_OUT,
            emit, mult, int(tail), adamw_constants(step, lr, beta1, beta2, eps, weight_decay))  # fmt: skip
    return args, emit


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
    """One AdamW step of the flat bf16 `param`, `exp_avg`, `exp_avg_sq` with the flat bf16
    `grad` (times `grad_multiplier`, rounded to bf16), as torch._fused_adamw_ on bf16 tensors
    with `step` (the count after this update), over the tasks `split` (kernels/fused_step.py
    `tasks`, with tail_from at VECTOR_FACTOR times the calibration's vector). `tail`: the
    calibration's AdamW tail form. `out` (as long as `param`): the new values too, in the same
    pass when bf16, else copied after it as `Tensor.to` rounds."""
    args, emit = _call(split, param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                       grad_multiplier, tail, out)  # fmt: skip
    launch(_adamw_bf16_state, *args)
    if out is not None and not emit:
        out.copy_(param)


def compiled() -> tuple[object, bool]:
    """As kernels/fused_step.py `compiled`, for this kernel (one compiled form)."""
    empty = torch.empty(0, dtype=torch.bfloat16)
    args, _ = _call(np.zeros((0, 3), dtype=np.int64), empty, empty, empty, empty, 1, 1.0, 0.9, 0.999, 1e-8, 0.0,
                    None, 0, None)  # fmt: skip
    signature = tuple(numba.typeof(a) for a in args)
    return (lambda: _adamw_bf16_state.compile(signature)), signature in _adamw_bf16_state.overloads
