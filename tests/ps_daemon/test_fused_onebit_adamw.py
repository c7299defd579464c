"""The daemon's fused 1-bit decompress + AdamW kernel (kernels/fused_adamw.py) against its
oracle: the torch reference decompression followed by torch.optim.AdamW(fused=True), one
tensor per parameter piece, each with its own weight decay.

Tolerance: rtol 1e-6, atol 1e-7 on master, m and v after several steps. Not bit-exact by
contract: torch's binary rounds the lerp and the second moment through fused multiply-adds
that its compiler chose (differently in the vector loop and the scalar tail); the kernel
follows them and agrees bit for bit on the machines tried, but another torch build or CPU
may round some elements one ulp apart, and a few ulps is what the tolerance allows.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fused_adamw import onebit_adamw_

# Pieces of one shard: lengths that are not multiples of 8 (torch's scalar tails) or of a
# block, a piece inside one block, pieces straddling blocks, weight decay on some only.
PIECES = [(37, 0.0), (5000, 0.1), (3, 0.0), (1024, 0.05), (2500, 0.1)]
STEPS = 6


def _pieces():
    segments, start = [], 0
    for length, decay in PIECES:
        segments.append((start, start + length, decay))
        start += length
    return segments, start


def _signs(n: int, step: int):
    """A 1-bit gradient as a trainer would send it: signs and block scales of random values."""
    g = torch.Generator().manual_seed(100 + step)
    c = torch.randn(n, generator=g) * (0.5 + step) + 0.1 * step
    return kernels.onebit_compress(c, None, backend="torch")


@pytest.mark.parametrize("beta1", [0.9, 0.3], ids=["lerp-small-weight", "lerp-large-weight"])
def test_fused_onebit_adamw_matches_decompress_then_torch_fused(beta1):
    segments, n = _pieces()
    torch.manual_seed(0)
    initial = torch.randn(n)
    master, m, v = initial.clone(), torch.zeros(n), torch.zeros(n)

    params = [torch.nn.Parameter(initial[s:e].clone()) for s, e, _ in segments]
    oracle = torch.optim.AdamW(
        [{"params": [p], "weight_decay": wd} for p, (_, _, wd) in zip(params, segments, strict=True)],
        lr=1e-3, betas=(beta1, 0.999), eps=1e-8, fused=True,
    )  # fmt: skip
    for step in range(1, STEPS + 1):
        lr = 1e-3 * (1 + step) / 2  # a schedule: lr travels with every push
        bits, scales = _signs(n, step)
        onebit_adamw_(
            master, m, v, bits, scales, segments=segments, step=step, lr=lr, beta1=beta1, beta2=0.999, eps=1e-8
        )

        grad = kernels.onebit_decompress(bits, scales, n, backend="torch")
        for p, (s, e, _) in zip(params, segments, strict=True):
            p.grad = grad[s:e].clone()
        for group in oracle.param_groups:
            group["lr"] = lr
        oracle.step()

    state = [oracle.state[p] for p in params]
    expected = {
        "master": torch.cat([p.detach() for p in params]),
        "m": torch.cat([s["exp_avg"] for s in state]),
        "v": torch.cat([s["exp_avg_sq"] for s in state]),
    }
    for name, ours in (("master", master), ("m", m), ("v", v)):
        torch.testing.assert_close(ours, expected[name], rtol=1e-6, atol=1e-7, msg=lambda text, n=name: f"{n}: {text}")
    assert not torch.equal(master, initial)


def test_weight_decay_is_per_piece_and_decoupled():
    """With lr 0 nothing moves; with zero signs' scales (a zero gradient) only the decay
    acts, p *= 1 - lr * wd, on exactly the pieces that have one."""
    segments, n = _pieces()
    master = torch.ones(n)
    m, v = torch.zeros(n), torch.zeros(n)
    bits = torch.zeros((n + 7) // 8, dtype=torch.uint8)
    scales = torch.zeros(-(-n // kernels.BLOCK))
    onebit_adamw_(master, m, v, bits, scales, segments=segments, step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8)
    assert torch.equal(master, torch.ones(n))
    onebit_adamw_(master, m, v, bits, scales, segments=segments, step=2, lr=0.5, beta1=0.9, beta2=0.999, eps=1e-8)
    for s, e, decay in segments:
        assert torch.equal(master[s:e], torch.full((e - s,), 1 - 0.5 * decay, dtype=torch.float32))


def test_bad_input_is_a_value_error():
    n = 2048
    ok = dict(segments=[(0, n, 0.0)], step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    state = [torch.zeros(n) for _ in range(3)]
    bits, scales = torch.zeros(n // 8, dtype=torch.uint8), torch.ones(2)
    with pytest.raises(ValueError, match="bits must be 256"):
        onebit_adamw_(*state, bits[:-1], scales, **ok)
    with pytest.raises(ValueError, match="scales must be 2"):
        onebit_adamw_(*state, bits, torch.ones(3), **ok)
    with pytest.raises(ValueError, match="exp_avg has 10"):
        onebit_adamw_(state[0], torch.zeros(10), state[2], bits, scales, **ok)
    with pytest.raises(ValueError, match="tile"):
        onebit_adamw_(*state, bits, scales, **{**ok, "segments": [(0, 100, 0.0), (200, n, 0.0)]})
    with pytest.raises(ValueError, match="step"):
        onebit_adamw_(*state, bits, scales, **{**ok, "step": 0})
