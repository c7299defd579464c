"""`nonfinite_check`: what refusing NaN and infinite pushes costs (issue #26; store.allow_nonfinite_pushes).

Every push's values are checked before they are applied (ps_daemon/model/encodings.check_finite:
one aminmax pass over the payload). Measured against the optimizer step it guards, on the
daemon's default shard (64 MiB of fp32 master, 16M elements), both running torch's fused CPU
kernels as the daemon does, interleaved (ABBA), median of the per-pair ratios:

* ours: the check of a RAW fp32 gradient, then the fused AdamW step;
* peer: the fused AdamW step alone.

Also recorded: the same against a fused SGD step (momentum 0.9), which moves fewer bytes, and
what the check costs on a BF16 payload (half the bytes read).
"""

from __future__ import annotations

import statistics

import torch

from bench.common import interleaved, quick, record, spread, timed
from ps_offload.daemon.model.encodings import CastGradient, check_finite

NUMEL = quick(16 << 20, 1 << 20)
REPS = quick(20, 4)


def _adamw(master, grad, m, v, step):
    step += 1
    torch._fused_adamw_(
        [master], [grad], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
        amsgrad=False, maximize=False,
    )  # fmt: skip


def _sgd(master, grad, buf, first):
    torch._fused_sgd_(
        [master], [grad], [buf], weight_decay=0.0, momentum=0.9, lr=1e-3, dampening=0.0, nesterov=False,
        maximize=False, is_first_step=first,
    )  # fmt: skip


def main() -> dict:
    torch.manual_seed(0)
    master, grad = torch.randn(NUMEL), torch.randn(NUMEL) * 1e-3
    m, v, buf, step = torch.zeros(NUMEL), torch.zeros(NUMEL), torch.zeros(NUMEL), torch.zeros(())
    half = CastGradient(grad.bfloat16())

    def checked_adamw():
        check_finite(grad, "push to shard 0")
        _adamw(master, grad, m, v, step)

    def checked_sgd():
        check_finite(grad, "push to shard 0")
        _sgd(master, grad, buf, False)

    adamw_checked, adamw_alone = interleaved(checked_adamw, lambda: _adamw(master, grad, m, v, step), reps=REPS)
    sgd_checked, sgd_alone = interleaved(checked_sgd, lambda: _sgd(master, grad, buf, False), reps=REPS)
    bf16_check = [timed(lambda: check_finite(half, "push to shard 0")) for _ in range(REPS)]
    ratios = [a / b for a, b in zip(adamw_checked, adamw_alone, strict=True)]
    sgd_ratios = [a / b for a, b in zip(sgd_checked, sgd_alone, strict=True)]
    ms = lambda times: round(1e3 * statistics.median(times), 3)  # noqa: E731
    return record(
        "nonfinite_check",
        ours=1e3 * statistics.median(adamw_checked),
        peer=1e3 * statistics.median(adamw_alone),
        unit="ms per 64 MiB shard",
        target=1.02,
        higher_is_better=False,
        ratio=statistics.median(ratios),
        notes=(
            f"the fused AdamW step of {NUMEL} fp32 elements with the non-finite check of its RAW gradient before it, "
            "against the step alone; interleaved ABBA, median of the per-pair ratios"
        ),
        extra={
            "ratio_spread": spread(ratios),
            "ms": {
                "adamw_checked": ms(adamw_checked),
                "adamw": ms(adamw_alone),
                "sgd_checked": ms(sgd_checked),
                "sgd": ms(sgd_alone),
                "check_bf16_payload": ms(bf16_check),
            },
            "ratio_sgd": round(statistics.median(sgd_ratios), 3),
            "ratio_sgd_spread": spread(sgd_ratios),
        },
    )


if __name__ == "__main__":
    main()
