"""optimizer_step: the daemon's AdamW step on 64M parameters through its own code path
(gradients in StagingPool buffers, ShardStore.push: shard lock, per-parameter fused kernel
over the shard arena, version bump), no network, vs torch.optim.AdamW(fused=True)
in-process on tensors of the same sizes.

Ratio = peer time / our time (parameters per second, ours over torch's); target >= 0.95.
"""

from __future__ import annotations

import contextlib

import torch

from bench.common import interleaved, median, record
from ps_offload.daemon.buffers import StagingPool
from ps_offload.daemon.optim import AdamWConfig
from ps_offload.daemon.store import ModelSpec, ParamSpec, ShardStore

N_PARAMS = 16  # 16 tensors of 4M elements = 64M parameters
NUMEL = 4 << 20


def main() -> dict:
    torch.manual_seed(0)
    config = AdamWConfig(lr=1e-4, weight_decay=0.1)
    store = ShardStore(ram_bytes=64 << 30, default_shard_bytes=64 << 20)
    spec = ModelSpec(
        "bench", tuple(ParamSpec(f"p{i}", (NUMEL,)) for i in range(N_PARAMS)), config, 64 << 20, ("local",)
    )
    model, _ = store.register(spec, 0)
    init = torch.randn(N_PARAMS * NUMEL)
    grads = torch.randn(N_PARAMS * NUMEL) * 1e-3
    for shard in model.plan:
        store.push("bench", shard.shard_id, step=0, kind="parameters", data=init[shard.offset : shard.end], lr=None)
    # Gradients sit where a push leaves them: in the daemon's staging buffers.
    staging = StagingPool(max_bytes=len(model.plan) * (64 << 20))
    held = contextlib.ExitStack()
    shard_grads = [held.enter_context(staging.borrow(s.numel)).copy_(grads[s.offset : s.end]) for s in model.plan]
    step = [0]

    def ours() -> None:
        for shard, grad in zip(model.plan, shard_grads, strict=True):
            store.push("bench", shard.shard_id, step=step[0], kind="gradient", data=grad, lr=None)
        step[0] += 1

    params = [init[i * NUMEL : (i + 1) * NUMEL].clone().requires_grad_() for i in range(N_PARAMS)]
    for i, p in enumerate(params):
        p.grad = grads[i * NUMEL : (i + 1) * NUMEL].clone()
    torch_opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)

    ours_t, peer_t = interleaved(ours, torch_opt.step, reps=40)
    held.close()
    n = N_PARAMS * NUMEL
    return record(
        "optimizer_step",
        ours=n / median(ours_t) / 1e9,
        peer=n / median(peer_t) / 1e9,
        unit="G params/s",
        target=0.95,
        higher_is_better=True,
        # Each rep runs ours and torch back to back (ABBA), so the per-pair ratio cancels the
        # machine's drift; their median is the figure (medians of each side alone moved
        # 0.89-0.98 between runs on this noisy 2-core VM).
        ratio=median([p / o for o, p in zip(ours_t, peer_t, strict=True)]),
        notes=f"{n / 1e6:.0f}M params in 64 MiB shards; ratio: median of 40 paired ABBA ratios; "
        f"{torch.get_num_threads()} torch threads",
    )


if __name__ == "__main__":
    main()
