"""Which form of the one-pass optimizer kernel (kernels/fused_step.py) computes as this
machine's torch, and its compiled kernels: found and made ready off the step's path.

A daemon's pushes never wait for either. Until the calibration is known and a push's kernel
is compiled (seconds each on a cold Numba cache, a fraction of a second from a warm one), the
daemon steps with torch's kernels, bit for bit the same; one background thread per process
does the work, the calibration first (`start`, at the daemon's start), then each kernel the
first push of its kind asks for (`ready`). `python -m ps_offload.kernels.step_calibration`
compiles them all into Numba's cache (make test's set-up does, so that the suite's daemons
only load them) and prints what it found.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ps_offload.kernels import bf16_state_step, fused_step

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "sgd")
BF16_STATE = "adamw_bf16_state"  # `ready`'s name for kernels/bf16_state_step.py (bf16 gradients only)


@dataclass(frozen=True)
class Calibration:
    """How this machine's torch build computes its fused AdamW and SGD (kernels/fused_step.py's
    note): `vector`, the elements of its vectorized body's step (a tensor's last numel % vector
    elements are its scalar tail); `adamw_tail`, the tail's form of v's update (0: the body's,
    1: fma(v, beta2, (1 - beta2) * g * g), 2: no fused multiply-add); `sgd_tail`, the tail's
    forms (weight decay fused or not; the momentum buffer as in the body (2), fma(buf,
    momentum, g * (1 - dampening)) (1) or unfused (0); Nesterov's add fused or not; the
    parameter's update fused or not)."""

    vector: int
    adamw_tail: int
    sgd_tail: tuple[int, int, int, int]
    bf16_state: bool = False  # kernels/bf16_state_step.py computes as torch on bf16 tensors too


ADAMW_TAILS = (0, 1, 2)
SGD_TAILS = tuple(itertools.product((1, 0), (2, 1, 0), (1, 0), (1, 0)))
VECTORS = (16, 8)


def calibration(*, wait: bool = True) -> Calibration | None:
    """What this machine's torch computes (Calibration), found by running its fused AdamW and
    SGD on a probe (many short tensors, so that most elements fall in a scalar tail, and a few
    long ones; with and without a multiplier, weight decay, both sides of the lerp, momentum,
    dampening, Nesterov, the first step; values over five orders of magnitude) and keeping the
    first form of the kernel that gives the same bits everywhere; None where none does (the
    daemon then keeps torch's kernels), and, with `wait` False, while it is still being found."""
    future = start()
    if not wait and not future.done():
        return None
    if future.exception() is not None:
        return None
    return future.result()


def ready(optimizer: str, grad_dtype: torch.dtype) -> Calibration | None:
    """The calibration, once it is known and `optimizer`'s ("adamw", "sgd", or BF16_STATE)
    kernel for gradients of `grad_dtype` is compiled in this process; else None, having set
    whichever is missing going in the background (the caller steps with torch's kernels
    meanwhile). None for BF16_STATE on a build where that kernel does not compute as torch."""
    found = calibration(wait=False)
    if found is None or (optimizer == BF16_STATE and not found.bf16_state):
        return None
    if (optimizer, grad_dtype) in _compiled:
        return found
    compile_kernel, compiled = _compiler(optimizer, grad_dtype)
    if compiled:
        _compiled.add((optimizer, grad_dtype))  # (a kernel stays compiled: not asked again)
        return found
    _work.once(("compile", optimizer, grad_dtype), compile_kernel)
    return None


def start() -> Future:
    """Starts finding the calibration in the background, once per process; its future."""
    return _work.once(("calibrate",), _calibrate)


def warm() -> Calibration | None:
    """Calibrates and compiles every kernel, waiting (the set-up's cache filling); raises what
    went wrong."""
    found = start().result()
    kernels = [*itertools.product(OPTIMIZERS, fused_step.GRAD_KINDS), (BF16_STATE, torch.bfloat16)]
    for optimizer, dtype in kernels:
        compile_kernel, compiled = _compiler(optimizer, dtype)
        if not compiled:
            _work.once(("compile", optimizer, dtype), compile_kernel).result()
    return found


def _compiler(optimizer: str, grad_dtype: torch.dtype):
    if optimizer == BF16_STATE:
        return bf16_state_step.compiled()
    return fused_step.compiled(optimizer, grad_dtype)


def _calibrate() -> Calibration | None:
    probe = _Probe()
    adamw = next(((v, t) for v in VECTORS for t in ADAMW_TAILS if probe.adamw_matches(v, t)), None)
    sgd = next(((v, t) for v in VECTORS for t in SGD_TAILS if probe.sgd_matches(v, t)), None)
    fused_step.all_finite(torch.zeros(8))  # the non-finite check's kernel (one, over 64-bit words)
    if adamw is None or sgd is None or adamw[0] != sgd[0]:
        return None
    bf16_state = probe.bf16_state_matches(*adamw)
    return Calibration(vector=adamw[0], adamw_tail=adamw[1], sgd_tail=sgd[1], bf16_state=bf16_state)


class _Background:
    """One thread that runs each piece of work once per process (a fork's child starts its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[tuple, Future] = {}

    def once(self, key: tuple, work) -> Future:
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._futures = os.getpid(), {}
                # Not a daemon thread: the interpreter's exit waits for a compile in flight
                # rather than meeting Numba's threads mid-launch.
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kernel-compile")
            future = self._futures.get(key)
            if future is None:
                future = self._futures[key] = self._pool.submit(work)
                future.add_done_callback(_say_if_failed)
            return future


def _say_if_failed(future: Future) -> None:
    if future.exception() is not None:  # (the daemon goes on with torch's kernels)
        log.error("the one-pass optimizer kernel's preparation failed: %r", future.exception())


_work = _Background()
_compiled: set[tuple[str, torch.dtype]] = set()


class _Probe:
    """The probe's tensors, and torch's results on them, computed once."""

    SHORT, COUNT = 31, 300  # 31 = 16 + 15 = 24 + 7: a body and a tail at either vector width
    LONG = (3 * fused_step.TASK + 64 * 5 + 13, 64 * 7)

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(39)
        self.lengths = [self.SHORT] * self.COUNT + list(self.LONG)
        n = sum(self.lengths)

        def spread(scale: float) -> torch.Tensor:  # values over five orders of magnitude
            return (torch.rand(n, generator=g) - 0.5) * scale * 10.0 ** torch.randint(-4, 1, (n,), generator=g).float()

        self.params, self.moments = spread(4.0), spread(0.02)
        self.squares = spread(1e-3).abs()
        # fp32 gradients: a bf16 or fp16 one is widened exactly before the same arithmetic (the
        # kernel tests check those against torch too), and each dtype is a kernel to compile.
        self.grads = {torch.float32: spread(0.5)}
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
        return fused_step.tasks(pieces)

    def adamw_matches(self, vector: int, tail: int) -> bool:
        split = self._tasks(vector)
        for kind, settings, expected in self.cases:
            if kind != "adamw":
                continue
            ours = [self.params.clone(), self.moments.clone(), self.squares.clone()]
            fused_step.adamw_(
                split, ours[0], self.grads[settings["dtype"]], ours[1], ours[2], step=3, lr=2e-3,
                beta1=settings["beta1"], beta2=0.999, eps=1e-8, weight_decay=settings["weight_decay"],
                grad_multiplier=settings["multiplier"], tail=tail,
            )  # fmt: skip
            if not all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True)):
                return False
        return True

    def bf16_state_matches(self, vector: int, tail: int) -> bool:
        """kernels/bf16_state_step.py with the fp32 kernel's forms against torch's fused AdamW
        on the probe's values rounded to bf16 (tests/kernels/test_bf16_state_step.py also places
        elements the forms tell apart at every position)."""
        split = self._tasks(bf16_state_step.VECTOR_FACTOR * vector)
        start = [t.bfloat16() for t in (self.params, self.moments, self.squares)]
        grad = self.grads[torch.float32].bfloat16()
        for beta1, decay, multiplier in ((0.9, 0.01, None), (0.3, 0.0, 0.375)):
            torchs = [t.clone() for t in start]
            scaled = grad if multiplier is None else (grad.float() * torch.tensor(multiplier)).bfloat16()
            views = [self._split(t) for t in torchs]
            torch._fused_adamw_(
                views[0], self._split(scaled.clone()), views[1], views[2], [], [torch.tensor(3.0)] * len(self.lengths),
                lr=2e-3, beta1=beta1, beta2=0.999, weight_decay=decay, eps=1e-8, amsgrad=False, maximize=False,
            )  # fmt: skip
            ours = [t.clone() for t in start]
            bf16_state_step.adamw_(
                split, ours[0], grad, ours[1], ours[2], step=3, lr=2e-3, beta1=beta1, beta2=0.999, eps=1e-8,
                weight_decay=decay, tail=tail, grad_multiplier=multiplier,
            )  # fmt: skip
            pairs = zip(ours, torchs, strict=True)
            if not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in pairs):
                return False
        return True

    def sgd_matches(self, vector: int, tail: tuple[int, int, int, int]) -> bool:
        split = self._tasks(vector)
        for kind, settings, expected in self.cases:
            if kind != "sgd":
                continue
            ours = [self.params.clone(), self.moments.clone()]
            fused_step.sgd_(
                split, ours[0], self.grads[settings["dtype"]], ours[1] if settings["momentum"] else None, lr=0.05,
                weight_decay=0.01, momentum=settings["momentum"], dampening=settings["dampening"],
                nesterov=settings["nesterov"], first_step=settings["first"], grad_multiplier=settings["multiplier"],
                tail=tail,
            )  # fmt: skip
            if not all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True)):
                return False
        return True


if __name__ == "__main__":
    started = time.perf_counter()
    print(f"{warm()} ({time.perf_counter() - started:.1f} s; torch {torch.__version__})")
