"""The daemon's fused 1-bit Adam step (kernels/fused_adamw.py) against its oracles: the same
update in plain torch on the decompressed momentum (`adam_frozen_variance_`), which is in
turn checked against the formula in float64.

Tolerance between the fused kernel and torch: rtol 1e-6, atol 1e-7 after several steps (the
compiler may contract a multiply-add that torch rounds twice); exp_avg is compared exactly
(it is the decompressed momentum) and exp_avg_sq must not change at all.
"""

from __future__ import annotations

import math

import pytest
import torch

from ps_offload import kernels
from ps_offload.kernels.fused_adamw import adam_frozen_variance_, onebit_adam_, step_cap

# Pieces of one shard: lengths that are not multiples of 8 or of a block, a piece inside one
# block, pieces straddling blocks, weight decay on some only.
PIECES = [(37, 0.0), (5000, 0.1), (3, 0.0), (1024, 0.05), (2500, 0.1)]
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8)


def _pieces():
    segments, start = [], 0
    for length, decay in PIECES:
        segments.append((start, start + length, decay))
        start += length
    return segments, start


def _momentum(n: int, step: int):
    """A 1-bit momentum as a trainer would send it: signs and block scales of random values."""
    g = torch.Generator().manual_seed(100 + step)
    c = torch.randn(n, generator=g) * (0.5 + step) + 0.1 * step
    return kernels.onebit_compress(c, None, backend="torch")


def _state(n: int):
    g = torch.Generator().manual_seed(0)
    p, m, v = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.rand(n, generator=g) * 1e-2
    v[::101] = 0.0  # the mask and the cap are part of what the fused kernel must match
    v[1::103] = 1e-16
    return p, m, v


def test_fused_onebit_adam_matches_the_torch_update_on_the_decompressed_momentum():
    segments, n = _pieces()
    ours, oracle = _state(n), _state(n)
    v_frozen = ours[2].clone()
    for step in range(21, 27):  # compression starts after 20 warm-up steps
        lr = 1e-3 * (1 + step) / 20  # a schedule: lr travels with every push
        bits, scales = _momentum(n, step)
        args = dict(segments=segments, step=step, variance_frozen_at=20, lr=lr, **HYPER)
        onebit_adam_(*ours, bits, scales, **args)
        adam_frozen_variance_(*oracle, kernels.onebit_decompress(bits, scales, n, backend="torch"), **args)
        assert torch.equal(ours[1], oracle[1])  # exp_avg: the decompressed momentum, exactly
    torch.testing.assert_close(ours[0], oracle[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(ours[2], v_frozen) and torch.equal(oracle[2], v_frozen)


def test_the_torch_update_is_adamw_with_the_variance_and_its_bias_correction_frozen():
    segments, n = _pieces()
    p, m, v = _state(n)
    v[::97] = 0.0  # no gradient in the warm-up: not moved by the momentum
    v[1::89] = 1e-14  # a tiny variance: the step is capped
    p64, v64 = p.double(), v.double()
    momentum = torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-3
    step, frozen, lr = 30, 12, 2e-3
    adam_frozen_variance_(p, m, v, momentum, segments=segments, step=step, variance_frozen_at=frozen, lr=lr, **HYPER)
    decay = torch.cat([torch.full((e - s,), 1 - lr * wd, dtype=torch.float64) for s, e, wd in segments])
    applied = torch.where(v64 > 0, momentum.double(), 0.0)
    u = applied / (1 - 0.9**step) / (v64.sqrt() / math.sqrt(1 - 0.999**frozen) + 1e-8)
    cap = 0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999))
    assert step_cap(0.9, 0.999) == pytest.approx(cap) and cap == pytest.approx(7.27, abs=0.01)
    assert (u.abs() > cap).sum() >= n // 89 - 1  # the tiny variances do hit the cap
    expected = p64 * decay - lr * u.clamp(-cap, cap)
    torch.testing.assert_close(p.double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(m, applied.float())


def test_the_step_cap_is_the_largest_ratio_adam_reaches():
    """R bounds |m_t / sqrt(v_t)| of exact Adam on any gradient sequence, and is reached: a
    gradient that grows by beta1 / beta2 each step drives the ratio to R."""
    for beta1, beta2 in ((0.9, 0.999), (0.9, 0.95), (0.5, 0.9)):
        cap = step_cap(beta1, beta2)
        m = v = 0.0
        worst = 0.0
        for t in range(300):
            g = (beta2 / beta1) ** t  # the Cauchy-Schwarz equality case: g_{t-k} proportional to (beta1/beta2)^k
            m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
            worst = max(worst, abs(m) / math.sqrt(v))
        assert worst <= cap * (1 + 1e-9) and worst > 0.99 * cap, (beta1, beta2, worst, cap)
    assert step_cap(0.99, 0.95) == math.inf


def test_weight_decay_is_per_piece_and_decoupled():
    """With lr 0 nothing moves; with zero scales (a zero momentum) only the decay acts,
    p *= 1 - lr * wd, on exactly the pieces that have one."""
    segments, n = _pieces()
    master, m, v = torch.ones(n), torch.zeros(n), torch.ones(n)
    bits = torch.zeros((n + 7) // 8, dtype=torch.uint8)
    scales = torch.zeros(-(-n // kernels.BLOCK))
    args = dict(segments=segments, variance_frozen_at=1, **HYPER)
    onebit_adam_(master, m, v, bits, scales, step=1, lr=0.0, **args)
    assert torch.equal(master, torch.ones(n))
    onebit_adam_(master, m, v, bits, scales, step=2, lr=0.5, **args)
    for s, e, decay in segments:
        assert torch.equal(master[s:e], torch.full((e - s,), 1 - 0.5 * decay, dtype=torch.float32))


def test_bad_input_is_a_value_error():
    n = 2048
    ok = dict(segments=[(0, n, 0.0)], step=3, variance_frozen_at=2, lr=1e-3, **HYPER)
    state = [torch.zeros(n) for _ in range(3)]
    bits, scales = torch.zeros(n // 8, dtype=torch.uint8), torch.ones(2)
    with pytest.raises(ValueError, match="bits must be 256"):
        onebit_adam_(*state, bits[:-1], scales, **ok)
    with pytest.raises(ValueError, match="scales must be 2"):
        onebit_adam_(*state, bits, torch.ones(3), **ok)
    with pytest.raises(ValueError, match="exp_avg has 10"):
        onebit_adam_(state[0], torch.zeros(10), state[2], bits, scales, **ok)
    with pytest.raises(ValueError, match="tile"):
        onebit_adam_(*state, bits, scales, **{**ok, "segments": [(0, 100, 0.0), (200, n, 0.0)]})
    for frozen, step in ((0, 3), (4, 3)):
        with pytest.raises(ValueError, match="variance_frozen_at"):
            onebit_adam_(*state, bits, scales, **{**ok, "step": step, "variance_frozen_at": frozen})
        with pytest.raises(ValueError, match="variance_frozen_at"):
            adam_frozen_variance_(*state, torch.zeros(n), **{**ok, "step": step, "variance_frozen_at": frozen})
