"""train_step_overhead: a training step of the demo model (examples/train_gpt.py defaults:
0.81M-parameter char GPT, batch 32 x 64) with AdamW on a local ps-daemon vs the same model
with torch.optim.AdamW(fused=True) in-process. A step = forward, backward, clip, optimizer
step (and, offloaded, the pulls the next forward waits for).

Ratio = our step time over the in-process one (lower is better); target <= 1.05 (issue 25).

`run(torch.bfloat16)` is train_step_overhead_bf16 (bench/train_step_overhead_bf16.py): the
same model in bf16 through the daemon (bf16 gradients pushed, bf16 values pulled) against
the in-process mixed-precision spelling, fp32 masters with torch.optim.AdamW(fused=True) and
the masters cast back into the bf16 parameters each step.
"""

from __future__ import annotations

import sys

import torch

from bench.common import REPO, STEP_PHASES, BenchDaemon, ProcessCpu, median, quick, record, spread, timed, timed_steps

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

from ps_offload import trainer  # noqa: E402

BLOCK_STEPS = 10
BLOCKS = quick(8, 2)
PHASES = STEP_PHASES


class MixedPrecisionAdamW:
    """The in-process mixed-precision spelling: fp32 masters of the half-precision parameters,
    torch.optim.AdamW(fused=True) on the masters, the masters cast back after each step."""

    def __init__(self, groups: list[dict], **kwargs) -> None:
        self.params = [p for g in groups for p in g["params"]]
        self.masters = {id(p): p.detach().float().clone() for p in self.params}
        master_groups = [{**g, "params": [self.masters[id(p)] for p in g["params"]]} for g in groups]
        self.optimizer = torch.optim.AdamW(master_groups, **kwargs)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            self.masters[id(p)].grad = p.grad.float()
        self.optimizer.step()
        for p in self.params:
            p.copy_(self.masters[id(p)])


def main() -> dict:
    return run(torch.float32)


def run(dtype: torch.dtype) -> dict:
    name = "train_step_overhead" + {torch.float32: "", torch.bfloat16: "_bf16", torch.float16: "_fp16"}[dtype]
    args = train_gpt.parse_args([])
    with BenchDaemon() as daemon:
        local_model, data = train_gpt.build(args)
        remote_model, _ = train_gpt.build(args)
        local_model.to(dtype)
        remote_model.to(dtype)
        decay = [p for n, p in local_model.named_parameters() if not train_gpt.no_weight_decay(n, p)]
        other = [p for n, p in local_model.named_parameters() if train_gpt.no_weight_decay(n, p)]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
        if dtype == torch.float32:
            local_opt = torch.optim.AdamW(groups, lr=args.lr, fused=True)
        else:
            local_opt = MixedPrecisionAdamW(groups, lr=args.lr, fused=True)
        remote_opt = trainer.offload(
            remote_model,
            daemons=[daemon.address],
            optimizer=trainer.AdamW(lr=args.lr, weight_decay=0.1),
            config=trainer.OffloadConfig(shard_bytes=args.shard_bytes),
            no_weight_decay=train_gpt.no_weight_decay,
        )
        batches = [data.batch(args.batch_size) for _ in range(BLOCK_STEPS)]

        # Where a step goes, per phase (ms lists): forward (offloaded, it includes waiting for
        # the pulls of the step before), backward, clip, optimizer step (offloaded: pushes
        # until the daemon acknowledged them). And the daemon's CPU time over each block.
        phases = {"ours": {k: [] for k in PHASES}, "in_process": {k: [] for k in PHASES}}
        daemon_cpu: list[float] = []

        def steps(model, opt):
            times = phases["ours" if opt is remote_opt else "in_process"]

            def run() -> None:
                cpu = ProcessCpu.of(daemon.process.pid)
                timed_steps(model, opt, batches, times, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                if opt is remote_opt:
                    opt.synchronize()
                    daemon_cpu.append(1000 * (ProcessCpu.of(daemon.process.pid) - cpu).seconds / len(batches))

            return run

        ours, peer = steps(remote_model, remote_opt), steps(local_model, local_opt)
        ours(), peer()  # warm-up
        for times in phases.values():
            for v in times.values():
                v.clear()
        daemon_cpu.clear()
        ours_t, peer_t = [], []
        for block in range(BLOCKS):
            pair = [(ours, ours_t), (peer, peer_t)]
            for fn, times in pair if block % 2 == 0 else pair[::-1]:
                times.append(timed(fn) / BLOCK_STEPS)
        remote_opt.close()
    n_params = sum(p.numel() for p in local_model.parameters())
    paired = [o / p for o, p in zip(ours_t, peer_t, strict=True)]
    return record(
        name,
        ours=1000 * median(ours_t),
        peer=1000 * median(peer_t),
        unit="ms/step",
        target=1.05,
        higher_is_better=False,
        # Per block pair (next to each other in time), so the machine's drift cancels.
        ratio=median(paired),
        extra={
            "ratio_spread": spread(paired),
            "ratio_of_medians": round(median(ours_t) / median(peer_t), 3),
            "phase_ms": {who: {k: round(median(v), 2) for k, v in t.items()} for who, t in phases.items()},
            "daemon_cpu_ms_per_step": round(median(daemon_cpu), 2),
        },
        notes=f"{n_params / 1e6:.2f}M-param char GPT in {str(dtype)[6:]}, {len(remote_opt.plan)} shards of "
        f"{args.shard_bytes} B (fp32 master bytes), "
        f"one local daemon; {BLOCKS} ABBA blocks of {BLOCK_STEPS} steps; ratio: median of the per-pair block ratios",
    )


if __name__ == "__main__":
    main()
