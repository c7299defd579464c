"""The daemon's one-pass AdamW and SGD (kernels/fused_step.py) against torch's fused kernels, the
oracle, bit for bit: whole parameters of odd sizes (so that their scalar tails are stepped),
cut into shard pieces at any offset, every gradient dtype, with and without a grad multiplier,
over several steps; and its non-finite check."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from ps_offload.kernels import fused_step, step_calibration

SIZES = (1, 7, 8, 15, 63, 64, 65, 130, 1000, 4097, 2 * fused_step.TASK + 3)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _values(n: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) - 0.5) * scale * 10.0 ** torch.randint(-4, 1, (n,), generator=g).float()


def _cut_tasks(sizes, cuts, vector):
    """The kernel's tasks for parameters of `sizes` laid end to end, cut at `cuts` (shard
    boundaries in the flat space): each piece with its parameter's tail start."""
    pieces, offset = [], 0
    bounds = sorted(set(cuts))
    for n in sizes:
        tail = offset + n - n % vector
        edges = [offset, *(c for c in bounds if offset < c < offset + n), offset + n]
        pieces += [(a, b, tail) for a, b in zip(edges, edges[1:], strict=False)]
        offset += n
    return fused_step.tasks(pieces)


def test_this_machines_torch_is_calibrated():
    found = step_calibration.calibration()
    assert found is not None, "no form of the one-pass kernel computes as this torch build: the daemon runs torch's"
    assert found.vector in step_calibration.VECTORS


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("multiplier", [None, 0.625])
@pytest.mark.parametrize(("beta1", "decay"), [(0.9, 0.1), (0.2, 0.0)])
def test_adamw_equals_torchs_fused_adamw_at_any_cut(dtype, multiplier, beta1, decay):
    calibration = step_calibration.calibration()
    total = sum(SIZES)
    split = _cut_tasks(SIZES, [5, 100, 1111, 3000, total - 70], calibration.vector)
    state = [_values(total, 4.0, 1), _values(total, 0.02, 2), _values(total, 1e-3, 3).abs()]
    ours = [t.clone() for t in state]
    for step in range(1, 4):
        grad = _values(total, 0.5, 10 + step).to(dtype)
        wide = grad.float() if multiplier is None else grad.float() * torch.tensor(multiplier, dtype=torch.float32)
        torch._fused_adamw_(
            *(list(torch.split(t, SIZES)) for t in (state[0], wide, state[1], state[2])), [],
            [torch.tensor(float(step))] * len(SIZES), lr=3e-3 * step, beta1=beta1, beta2=0.999, weight_decay=decay,
            eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
        fused_step.adamw_(
            split, ours[0], grad, ours[1], ours[2], step=step, lr=3e-3 * step, beta1=beta1, beta2=0.999, eps=1e-8,
            weight_decay=decay, tail=calibration.adamw_tail, grad_multiplier=multiplier,
        )  # fmt: skip
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, state, strict=True):
            assert torch.equal(a, b), f"step {step} {name}: {int((a != b).sum())} elements differ"


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("multiplier", [None, 0.625])
@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "decay"),
    [(0.0, 0.0, False, 0.01), (0.9, 0.0, False, 0.0), (0.9, 0.2, False, 0.01), (0.9, 0.0, True, 0.01)],
)
def test_sgd_equals_torchs_fused_sgd_at_any_cut(dtype, multiplier, momentum, dampening, nesterov, decay):
    calibration = step_calibration.calibration()
    total = sum(SIZES)
    split = _cut_tasks(SIZES, [64, 999, 4000, total - 1], calibration.vector)
    state = [_values(total, 4.0, 4), torch.zeros(total)]
    ours = [t.clone() for t in state]
    for step in range(1, 4):
        grad = _values(total, 0.5, 20 + step).to(dtype)
        wide = grad.float() if multiplier is None else grad.float() * torch.tensor(multiplier, dtype=torch.float32)
        torch._fused_sgd_(
            list(torch.split(state[0], SIZES)), list(torch.split(wide, SIZES)),
            list(torch.split(state[1], SIZES)) if momentum else [], weight_decay=decay, momentum=momentum,
            lr=0.05 / step, dampening=dampening, nesterov=nesterov, maximize=False, is_first_step=step == 1,
        )  # fmt: skip
        fused_step.sgd_(
            split, ours[0], grad, ours[1] if momentum else None, lr=0.05 / step, weight_decay=decay,
            momentum=momentum, dampening=dampening, nesterov=nesterov, first_step=step == 1,
            tail=calibration.sgd_tail, grad_multiplier=multiplier,
        )  # fmt: skip
        assert torch.equal(ours[0], state[0]), f"step {step}: {int((ours[0] != state[0]).sum())} params differ"
        assert torch.equal(ours[1], state[1]), f"step {step}: the momentum buffers differ"


def test_another_tail_form_would_differ():
    """The calibration's tail form matters: another one gives other bits on the probe, so the
    tests above could tell (a kernel that ignored the tail would fail them)."""
    calibration = step_calibration.calibration()
    probe = step_calibration._Probe()
    others = [t for t in step_calibration.ADAMW_TAILS if t != calibration.adamw_tail]
    assert probe.adamw_matches(calibration.vector, calibration.adamw_tail)
    assert others and not any(probe.adamw_matches(calibration.vector, t) for t in others)
    other_width = [v for v in step_calibration.VECTORS if v != calibration.vector]
    assert not any(probe.adamw_matches(v, calibration.adamw_tail) for v in other_width)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 4096, 3 * fused_step.TASK - 1])
def test_all_finite_finds_a_nan_or_an_infinity_anywhere(dtype, bad, where):
    values = _values(3 * fused_step.TASK, 1.0, 5).to(dtype)
    values[7] = torch.finfo(dtype).tiny / 4  # a subnormal is finite
    values[8] = torch.finfo(dtype).max
    assert fused_step.all_finite(values)
    values[where] = bad
    assert not fused_step.all_finite(values)
    if where:  # from the second element on: another split into head, words and tail
        assert not fused_step.all_finite(values[1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_all_finite_judges_every_16_bit_pattern_in_every_lane(dtype):
    """The check reads 64-bit words (4 lanes of 16 bits), and the elements before the first
    8-byte boundary and after the last apart: every finite pattern passes, and each NaN and
    infinity pattern is found in each lane of a word, in the head and in the tail."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns)
    assert fused_step.all_finite(patterns[finite])
    values = torch.zeros(4 * 64 + 3, dtype=dtype)  # torch's storage is 64-byte aligned
    shifted = values[1:]  # 3 elements before its first 8-byte boundary, 2 after its last
    for bad in patterns[~finite]:
        for at in (4 * 10, 4 * 10 + 1, 4 * 10 + 2, 4 * 10 + 3, 0, 2, shifted.numel() - 1):
            shifted[at] = bad
            assert not fused_step.all_finite(shifted), (at, bad)
            shifted[at] = 0.0
    assert fused_step.all_finite(shifted)


def test_fp16_gradients_widen_and_fp16_pulls_round_as_torch_converts_every_value():
    """fp16 in and out (kernels/fused_step.py HARDWARE_HALF: the CPU's conversions where it has
    them): every finite fp16 gradient pattern widens exactly (a step of lr 1 from zero gives 0 - g), and
    fp32 values of every kind (subnormal in fp16, past its largest, ties, NaN) round into the
    pull as Tensor.to(torch.float16) rounds them."""
    calibration = step_calibration.calibration()
    grad = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    grad = grad[torch.isfinite(grad)]
    param, out = torch.zeros(grad.numel()), torch.empty(grad.numel(), dtype=torch.float16)
    split = fused_step.tasks([(0, grad.numel(), grad.numel())])
    sgd = dict(weight_decay=0.0, momentum=0.0, dampening=0.0, nesterov=False, first_step=True,
               tail=calibration.sgd_tail)  # fmt: skip
    fused_step.sgd_(split, param, grad, None, lr=1.0, out=out, **sgd)
    want = torch.zeros(grad.numel()) - grad.float()  # (0 - g: the step's fma(g, -1, 0), signed zeros alike)
    assert torch.equal(param.view(torch.int32), want.view(torch.int32))
    assert torch.equal(out.view(torch.int16), want.to(torch.float16).view(torch.int16))
    bits = torch.randint(-(1 << 31), 1 << 31, (1 << 18,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    param = torch.cat([bits.to(torch.int32).view(torch.float32), torch.tensor([65504.0, 65520.0, 65519.996, 2.0**-25,
                      2.0**-24 * 1.5, -(2.0**-25) * 1.0000001, math.nan, -math.inf])])  # fmt: skip
    out = torch.empty(param.numel(), dtype=torch.float16)
    split = fused_step.tasks([(0, param.numel(), param.numel())])
    fused_step.sgd_(split, param, torch.zeros(param.numel(), dtype=torch.float16), None, lr=1.0, out=out, **sgd)
    kept = slice(None) if fused_step.HARDWARE_HALF else ~torch.isnan(param)  # (else a NaN becomes 0x7E00)
    assert torch.equal(out[kept].view(torch.int16), param[kept].to(torch.float16).view(torch.int16))


@pytest.mark.parametrize("out_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "sgd_without_momentum"])
def test_the_new_values_also_land_in_out_as_to_dtype_rounds_them(out_dtype, grad_dtype, optimizer):
    """`out` (the pull a push carries with it): the stepped values rounded as Tensor.to, in the
    same pass when it has the gradient's dtype, after it when not; the step itself unchanged
    (each of SGD's loops, with momentum and without, emits in a loop of its own)."""
    calibration = step_calibration.calibration()
    total = sum(SIZES)
    split = _cut_tasks(SIZES, [777, 5000], calibration.vector)
    grad = _values(total, 0.5, 31).to(grad_dtype)
    runs = []
    for out in (None, torch.full((total,), 7.0).to(out_dtype)):
        state = [_values(total, 4.0, 32), _values(total, 0.02, 33), _values(total, 1e-3, 34).abs()]
        if optimizer == "adamw":
            fused_step.adamw_(split, state[0], grad, state[1], state[2], step=2, lr=1e-3, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.1, tail=calibration.adamw_tail, out=out)  # fmt: skip
        else:
            momentum = 0.9 if optimizer == "sgd" else 0.0
            fused_step.sgd_(split, state[0], grad, state[1] if momentum else None, lr=0.05, weight_decay=0.01,
                            momentum=momentum, dampening=0.0, nesterov=bool(momentum), first_step=False,
                            tail=calibration.sgd_tail, out=out)  # fmt: skip
        runs.append((state, out))
    (plain, _), (state, out) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, state, strict=True))
    assert torch.equal(out, state[0].to(out_dtype))


def test_a_kernel_not_yet_compiled_is_compiled_in_the_background_once(monkeypatch):
    """`ready` never compiles on the caller's thread: None (torch's kernels) until the kernel is
    compiled, the compile asked for once however often the step asks."""
    calibration = step_calibration.calibration()
    compiles = []
    done = threading.Event()

    def compiled(optimizer, grad_dtype):
        return (lambda: (compiles.append((optimizer, grad_dtype)), done.wait(30))), False

    monkeypatch.setattr(fused_step, "compiled", compiled)
    monkeypatch.setattr(step_calibration, "_compiled", set())
    key = ("compile", "sgd", torch.float16)
    monkeypatch.delitem(step_calibration._work._futures, key, raising=False)
    assert step_calibration.ready("sgd", torch.float16) is None
    assert step_calibration.ready("sgd", torch.float16) is None  # asked again while compiling
    done.set()
    step_calibration._work.once(key, None).result(timeout=30)
    assert compiles == [("sgd", torch.float16)]
    monkeypatch.setattr(fused_step, "compiled", lambda optimizer, grad_dtype: (None, True))
    assert step_calibration.ready("sgd", torch.float16) == calibration
    step_calibration._work._futures.pop(key)
