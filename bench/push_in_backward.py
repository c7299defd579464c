"""push_in_backward: a training step of the demo model (examples/train_gpt.py defaults, as
train_step_overhead: 0.81M-parameter char GPT, batch 32 x 64, AdamW on one local ps-daemon,
the gradient clipped to norm 1.0 by `opt.clip_grad_norm_`, which leaves the scaling to the
daemons so that what was pushed during backward stays the gradient) with
`OffloadConfig(push_in_backward=True)` against the same step with the default (every shard
pushed once backward and clip are done). Issue 40's target: the update started in backward
costs no more than the default, <= 1.0.

Both optimizers train models of their own on the same daemon, in blocks of steps, ABBA; a
block's time covers forward, backward, clip, step and, at its end, the wait for the last
pulls. Ratio = push_in_backward's block time over the default's, median of the pairs. Also
each one's time per phase (median ms), which says where the difference goes, and how the
daemon took the parts (PushHeader.speculate: steps computed during backward and adopted by
their APPLY, or redone when the clip fired).
"""

from __future__ import annotations

import sys

import torch

from bench.common import (
    REPO,
    STEP_PHASES,
    BenchDaemon,
    daemon_stats,
    interleaved,
    median,
    quick,
    record,
    spread,
    timed_steps,
)

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

from ps_offload import trainer  # noqa: E402

BLOCK_STEPS = 10
BLOCKS = quick(8, 2)


def _offload(address: str, args, name: str, *, push_in_backward: bool):
    torch.manual_seed(0)
    model, _ = train_gpt.build(args)
    opt = trainer.offload(
        model,
        daemons=[address],
        optimizer=trainer.AdamW(lr=args.lr, weight_decay=0.1),
        config=trainer.OffloadConfig(shard_bytes=args.shard_bytes, model_name=name, push_in_backward=push_in_backward),
        no_weight_decay=train_gpt.no_weight_decay,
    )
    return model, opt


def main() -> dict:
    args = train_gpt.parse_args([])
    with BenchDaemon() as daemon:
        _, data = train_gpt.build(args)
        batches = [data.batch(args.batch_size) for _ in range(BLOCK_STEPS)]
        runs = {
            "default": _offload(daemon.address, args, "pib-default", push_in_backward=False),
            "push_in_backward": _offload(daemon.address, args, "pib-backward", push_in_backward=True),
        }
        phases = {who: {k: [] for k in STEP_PHASES} for who in runs}

        def block(who: str):
            model, opt = runs[who]

            def run() -> None:
                # opt.clip_grad_norm_ leaves the scaling to the daemons: early parts stay usable.
                timed_steps(model, opt, batches, phases[who], lambda: opt.clip_grad_norm_(1.0))
                opt.synchronize()

            return run

        for who in runs:  # warm-up (registration, first pulls), not counted
            block(who)()
            for times in phases[who].values():
                times.clear()
        backward, default = interleaved(block("push_in_backward"), block("default"), reps=BLOCKS, warmup=0)
        stats = daemon_stats(daemon.address)  # how the daemon took the parts: computed ahead, adopted or redone
        for _, opt in runs.values():
            opt.close()
    paired = [b / d for b, d in zip(backward, default, strict=True)]
    return record(
        "push_in_backward",
        ours=1000 * median(backward) / BLOCK_STEPS,
        peer=1000 * median(default) / BLOCK_STEPS,
        unit="ms/step",
        target=1.0,
        higher_is_better=False,
        ratio=median(paired),
        extra={
            "ratio_spread": spread(paired),
            "phase_ms": {who: {k: round(median(v), 2) for k, v in t.items()} for who, t in phases.items()},
            "speculative_steps": {"adopted": stats.speculative_steps, "redone": stats.speculative_redone},
        },
        notes=f"demo char GPT (fp32, clip_grad_norm_ 1.0), shards of {args.shard_bytes} B, one local daemon; "
        f"OffloadConfig(push_in_backward=True) against the default; {BLOCKS} ABBA blocks of {BLOCK_STEPS} steps",
    )


if __name__ == "__main__":
    main()
