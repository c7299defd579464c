"""fused_decompress_adamw: the daemon's fused 1-bit Adam step (kernels/fused_adamw.py: a
ONEBIT MOMENTUM push, decompressed into exp_avg and applied with the frozen exp_avg_sq in one
pass) on one 64 MiB shard (16M elements), vs torch's fused AdamW (`torch._fused_adamw_`, the
kernel of torch.optim.AdamW(fused=True)) on an fp32 gradient of the same size: the step the
daemon runs for an uncompressed push.

Both run on memory laid out as the daemon lays it out: master, m and v in a shard arena,
1 KiB apart modulo 4 KiB (ps_offload.daemon.store.shard.ARENA_STAGGER), and torch's gradient in a staging
buffer 3 KiB into its page (ps_offload.daemon.rpc.staging). Ours reads the 1-bit payload instead: 16M
sign bits and 16K scales (2.1 MB against torch's 64 MiB gradient). The JIT is warmed first.

The two do different amounts of work, and the time ratio is not a claim that our kernel is
the faster code: it is the gain of moving less. Per element ours reads master and v and writes
master and m (16 bytes, plus 1/8 byte of signs and a scale per 1024 elements); torch's AdamW
reads master, m, v and the gradient and writes master, m and v (28 bytes). So beside the time
ratio the result file has `ratio_per_byte`: ours over torch in bytes moved per second, the
figure that says how close each runs to the memory bandwidth.

Ratio = torch time / our time (higher is better); target >= 1.0. The JSON also has the path
the fused kernel replaces: decompress into a staging buffer, then the same update in plain
torch ops (`adam_frozen_variance_`).
"""

from __future__ import annotations

import torch

from bench.common import interleaved, median, quick, record, spread
from ps_offload import kernels
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.store.shard import ARENA_STAGGER, arena_numel
from ps_offload.kernels.fused_adamw import adam_frozen_variance_, onebit_adam_

NUMEL = 16 << 20
# Bytes each step moves per element (see the module doc): ours p, v in and p, m out, the
# signs and one fp32 scale per 1024-element block; torch p, m, v, g in and p, m, v out.
OURS_BYTES_PER_ELEMENT = 16 + 1 / 8 + 4 / 1024
TORCH_BYTES_PER_ELEMENT = 28
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.1
FROZEN = 100  # the warm-up's updates, after which exp_avg_sq stays


def _arena() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """master, m, v placed as in a daemon's shard arena."""
    arena = torch.zeros(arena_numel(NUMEL, 2))
    step = NUMEL + ARENA_STAGGER
    master, m, v = (arena[i * step : i * step + NUMEL] for i in range(3))
    master.copy_(torch.randn(NUMEL))
    v.copy_(torch.rand(NUMEL) * 1e-6 + 1e-9)  # as a warm-up leaves it: no element without a gradient
    return master, m, v


def main() -> dict:
    torch.manual_seed(0)
    c = torch.randn(NUMEL) * 1e-3
    bits, scales = kernels.onebit_compress(c, None)
    ours_state, torch_state, staged_state = _arena(), _arena(), _arena()
    pool = StagingPool(max_bytes=2 * NUMEL * 4)
    with pool.borrow(NUMEL) as grad, pool.borrow(NUMEL) as scratch:
        kernels.onebit_decompress(bits, scales, NUMEL, out=grad)  # torch gets the same gradient, in fp32
        steps = {"ours": FROZEN, "torch": 0, "staged": FROZEN}
        one_bit_adam = dict(segments=[(0, NUMEL, WD)], variance_frozen_at=FROZEN, lr=LR, beta1=BETAS[0],
                            beta2=BETAS[1], eps=EPS)  # fmt: skip

        def ours() -> None:
            steps["ours"] += 1
            onebit_adam_(*ours_state, bits, scales, step=steps["ours"], **one_bit_adam)

        def torch_fused(state=torch_state, key="torch") -> None:
            steps[key] += 1
            master, m, v = state
            torch._fused_adamw_([master], [grad], [m], [v], [], [torch.tensor(float(steps[key]))], lr=LR,
                                beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD, eps=EPS, amsgrad=False,
                                maximize=False)  # fmt: skip

        def decompress_then_torch() -> None:
            kernels.onebit_decompress(bits, scales, NUMEL, out=scratch)
            steps["staged"] += 1
            adam_frozen_variance_(*staged_state, scratch, step=steps["staged"], **one_bit_adam)

        ours()  # JIT compile (or load from the on-disk cache) outside the timings
        kernels.onebit_decompress(bits, scales, NUMEL, out=scratch)
        ours_t, torch_t = interleaved(ours, torch_fused, reps=quick(40, 6), warmup=2)
        ours_t2, staged_t = interleaved(ours, decompress_then_torch, reps=quick(20, 2), warmup=1)
    gparams = NUMEL / 1e9
    time_ratios = [p / o for o, p in zip(ours_t, torch_t, strict=True)]
    per_byte = OURS_BYTES_PER_ELEMENT / TORCH_BYTES_PER_ELEMENT
    return record(
        "fused_decompress_adamw",
        ours=gparams / median(ours_t),
        peer=gparams / median(torch_t),
        unit="G params/s",
        target=1.0,
        higher_is_better=True,
        # Per-pair ratios (ABBA), as in optimizer_step: the machine's drift cancels in a pair.
        ratio=median(time_ratios),
        notes=f"{NUMEL >> 20}M params (one 64 MiB shard), 1-bit payload {bits.numel() + 4 * scales.numel()} bytes; "
        f"ratio: median of {len(time_ratios)} paired ABBA time ratios; less work, not faster code: ours moves "
        f"{OURS_BYTES_PER_ELEMENT:.2f} bytes per element, torch {TORCH_BYTES_PER_ELEMENT}; ratio_per_byte = "
        f"bytes/s ours over torch's; {torch.get_num_threads()} threads",
        extra={
            "bytes_per_element": {"ours": round(OURS_BYTES_PER_ELEMENT, 3), "torch": TORCH_BYTES_PER_ELEMENT},
            "ratio_per_byte": round(median(time_ratios) * per_byte, 3),
            "gbytes_per_s": {
                "ours": round(NUMEL * OURS_BYTES_PER_ELEMENT / median(ours_t) / 1e9, 2),
                "torch": round(NUMEL * TORCH_BYTES_PER_ELEMENT / median(torch_t) / 1e9, 2),
            },
            "ratio_spread": spread(time_ratios),
            "ours_ms": round(1000 * median(ours_t), 2),
            "torch_fused_adamw_ms": round(1000 * median(torch_t), 2),
            "decompress_then_torch_ops_ms": round(1000 * median(staged_t), 2),
            "ratio_vs_decompress_then_torch_ops": round(
                median([p / o for o, p in zip(ours_t2, staged_t, strict=True)]), 3
            ),
        },
    )


if __name__ == "__main__":
    main()
