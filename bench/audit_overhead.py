"""audit_overhead: a training step of the demo model (examples/train_gpt.py defaults: 0.81M-
parameter char GPT, batch 32 x 64, AdamW, two param groups, clipping) on a local ps-daemon
with the parity audit on, `OffloadConfig(audit_every=100)` (trainer/offload/audit.py), against the
same model on the same daemon with it off. A step = forward, backward, clip, optimizer step;
each block of 100 steps holds one audit (one shard's state pulled before and after its step
and the step recomputed by torch.optim in process).

Ratio = the audited step time over the plain one (lower is better), the median of per-block
pairs run in ABBA order; target <= 1.02. The audits' own time (`opt.audit.stats.seconds`) is
reported too, as a share of the plain steps it is spread over: a figure the machine's noise
does not move.
"""

from __future__ import annotations

import sys

import torch

from bench.common import REPO, BenchDaemon, interleaved, median, quick, record, spread

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

from ps_offload import trainer  # noqa: E402

EVERY = quick(100, 10)  # steps per audit, and per block: every block holds one audit
BLOCKS = quick(3, 2)  # block pairs measured
WARMUP_STEPS = quick(10, 5)  # each, first (fewer than EVERY: the blocks then hold one audit each)


def main() -> dict:
    args = train_gpt.parse_args([])
    with BenchDaemon() as daemon:
        audited_model, data = train_gpt.build(args)
        plain_model, _ = train_gpt.build(args)
        opts = {}
        for name, model, every in (("audited", audited_model, EVERY), ("plain", plain_model, 0)):
            opts[name] = trainer.offload(
                model,
                daemons=[daemon.address],
                optimizer=trainer.AdamW(lr=args.lr, weight_decay=0.1),
                no_weight_decay=train_gpt.no_weight_decay,
                config=trainer.OffloadConfig(model_name=name, shard_bytes=args.shard_bytes, audit_every=every),
            )
        batches = [data.batch(args.batch_size) for _ in range(EVERY)]

        def steps(model, opt, count: int = EVERY):
            def run() -> None:
                for x, y in batches[:count]:
                    _, loss = model(x, y)
                    opt.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                opt.synchronize()

            return run

        steps(audited_model, opts["audited"], WARMUP_STEPS)()  # the audited one's first audit: step 0
        steps(plain_model, opts["plain"], WARMUP_STEPS)()
        ours_t, peer_t = interleaved(
            steps(audited_model, opts["audited"]), steps(plain_model, opts["plain"]), reps=BLOCKS, warmup=0
        )
        stats = opts["audited"].audit.stats
        shards = len(opts["audited"].plan)
        for opt in opts.values():
            opt.close()
    ours_ms, peer_ms = [1000 * t / EVERY for t in ours_t], [1000 * t / EVERY for t in peer_t]
    paired = [o / p for o, p in zip(ours_ms, peer_ms, strict=True)]
    if stats.audited != BLOCKS + 1 or stats.mismatches or stats.skipped:
        raise RuntimeError(f"expected a passing audit in the warm-up and in each block ({BLOCKS + 1}), got {stats}")
    audit_ms = 1000 * stats.seconds / stats.audited
    n_params = sum(p.numel() for p in plain_model.parameters())
    return record(
        "audit_overhead",
        ours=median(ours_ms),
        peer=median(peer_ms),
        unit="ms/step",
        target=1.02,
        higher_is_better=False,
        ratio=median(paired),
        extra={
            "ratio_spread": spread(paired),
            "audit_every": EVERY,
            "audits": stats.audited,
            "audit_ms": round(audit_ms, 2),
            # The audits' own time over the plain steps between them: what the ratio should show.
            "audit_share": round(audit_ms / (EVERY * median(peer_ms)), 4),
        },
        notes=f"{n_params / 1e6:.2f}M-param char GPT in float32, {shards} shards of {args.shard_bytes} B, one local "
        f"daemon holding both models; audit_every={EVERY}; {BLOCKS} ABBA pairs of {EVERY}-step blocks after "
        f"{WARMUP_STEPS} warm-up steps each; ratio: median of the per-pair block ratios",
    )


if __name__ == "__main__":
    main()
