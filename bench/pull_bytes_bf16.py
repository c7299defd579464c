"""pull_bytes_bf16: bytes the daemon sends per training step for the demo model (0.81M-parameter
char GPT) in bf16 against the same model in fp32, counted by the daemon (Admin Stats
bytes_pulled) over the same steps. Target 0.5: a bf16 pull moves the master rounded to
2 bytes per element, nothing else; any header or resent byte would show.

    python -m bench.pull_bytes_bf16
"""

from __future__ import annotations

import sys

import torch

from bench.common import REPO, BenchDaemon, daemon_stats, quick, record

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

from ps_offload import trainer  # noqa: E402

STEPS = quick(20, 3)


def pulled_per_step(dtype: torch.dtype) -> tuple[float, int]:
    """Bytes pulled per step (as the daemon counts them) and the model's element count."""
    args = train_gpt.parse_args([])
    with BenchDaemon() as daemon:
        model, data = train_gpt.build(args)
        model.to(dtype)
        with trainer.offload(
            model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=args.lr),
            config=trainer.OffloadConfig(shard_bytes=args.shard_bytes),
        ) as opt:  # fmt: skip
            before = daemon_stats(daemon.address).bytes_pulled
            for _ in range(STEPS):
                x, y = data.batch(args.batch_size)
                opt.zero_grad()
                model(x, y)[1].backward()
                opt.step()
            opt.synchronize()
            return (daemon_stats(daemon.address).bytes_pulled - before) / STEPS, opt.flat.numel


def main() -> dict:
    fp32, numel = pulled_per_step(torch.float32)
    bf16, _ = pulled_per_step(torch.bfloat16)
    return record(
        "pull_bytes_bf16",
        ours=bf16,
        peer=fp32,
        unit="bytes/step",
        target=0.5,
        higher_is_better=False,
        extra={"elements": numel, "steps": STEPS},
        notes=f"demo char GPT ({numel} elements in the plan), one local daemon, {STEPS} steps each; "
        "bytes_pulled from the daemon's Stats",
    )


if __name__ == "__main__":
    main()
