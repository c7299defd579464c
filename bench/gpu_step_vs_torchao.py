"""gpu_step_vs_torchao: training steps of a ~1.2B-parameter bf16 GPT on one GPU, its AdamW
through a local ps-daemon (fp32 master and state on the daemon, bf16 shards over the data
plane), against torchao's CPUOffloadOptimizer (the offload a single-GPU user would pick
instead) on the same model, batch and dtype, in the same run. Needs CUDA and torchao (`pip
install torchao` on the GPU machine); without either it says so and records nothing.

Ours and the peer run in alternating blocks of steps (ABBA), each on its own copy of the model;
ratio = median of the per-pair ratios of steps per second (ours over torchao's; target >= 1.0).
Beside it, each one's GPU idle fraction per step: 1 - (time the compute stream was busy with
forward and backward, from CUDA events) / (the step's wall time).

    python -m bench.gpu_step_vs_torchao
    python -m bench.gpu_step_vs_torchao --n-layer 4 --blocks 4 --block-steps 3   # smaller: a check

A run smaller than the defaults is recorded as scaled down (bench/results/quick/), never over
the real figure.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import BenchDaemon, median, quick, record, spread
from ps_offload import trainer
from ps_offload.trainer.debug_models import GPTConfig, TinyGPT

N_LAYER = quick(24, 2)
N_EMBD = quick(2048, 256)
BATCH = 4
BLOCK_STEPS = quick(5, 2)
BLOCKS = quick(6, 2)


def _model(config: GPTConfig) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(config).to("cuda", torch.bfloat16)


def _runner(model, opt, batch, block_steps: int):
    """One block of steps; returns (seconds per step, GPU idle fraction)."""
    x, y = batch

    def run() -> tuple[float, float]:
        busy = 0.0
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(block_steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            model(x, y)[1].backward()
            end.record()
            opt.step()
            opt.zero_grad()
            end.synchronize()
            busy += begin.elapsed_time(end) / 1000
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - started) / block_steps
        return per_step, 1 - busy / block_steps / per_step

    return run


def main(
    *, n_layer: int = N_LAYER, n_embd: int = N_EMBD, blocks: int = BLOCKS, block_steps: int = BLOCK_STEPS
) -> dict | None:
    """The defaults are the benchmark; anything smaller is recorded as scaled down."""
    config = GPTConfig(vocab_size=32768, block_size=1024, n_layer=n_layer, n_head=16, n_embd=n_embd)
    scaled_down = (n_layer, n_embd, blocks, block_steps) != (N_LAYER, N_EMBD, BLOCKS, BLOCK_STEPS)
    if not torch.cuda.is_available():
        print("gpu_step_vs_torchao: skipped, no CUDA device")
        return None
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        print("gpu_step_vs_torchao: skipped, torchao is not installed (pip install torchao)")
        return None
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.vocab_size, (BATCH, config.block_size + 1), generator=g).cuda()
    batch = (tokens[:, :-1], tokens[:, 1:])
    # 1.2B parameters x 12 bytes of AdamW state: all in the daemon's RAM tier.
    with BenchDaemon("--ram-bytes", str(32 << 30)) as daemon:
        ours_model, peer_model = _model(config), _model(config)
        n_params = sum(p.numel() for p in ours_model.parameters())
        ours_opt = trainer.offload(
            ours_model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-4, weight_decay=0.1),
            config=trainer.OffloadConfig(shard_bytes=64 << 20),
        )  # fmt: skip
        peer_opt = CPUOffloadOptimizer(peer_model.parameters(), torch.optim.AdamW, fused=True, lr=1e-4,
                                       weight_decay=0.1)  # fmt: skip
        ours, peer = (
            _runner(ours_model, ours_opt, batch, block_steps),
            _runner(peer_model, peer_opt, batch, block_steps),
        )
        ours(), peer()  # warm-up
        times = {"ours": [], "torchao": []}
        for block in range(blocks):
            pair = [("ours", ours), ("torchao", peer)]
            for who, fn in pair if block % 2 == 0 else pair[::-1]:
                times[who].append(fn())
        ours_opt.close()
    paired = [p[0] / o[0] for o, p in zip(times["ours"], times["torchao"], strict=True)]  # steps/s ours / theirs
    return record(
        "gpu_step_vs_torchao",
        ours=1 / median([t for t, _ in times["ours"]]),
        peer=1 / median([t for t, _ in times["torchao"]]),
        unit="steps/s",
        target=1.0,
        higher_is_better=True,
        ratio=median(paired),
        extra={
            "ratio_spread": spread(paired),
            "gpu_idle_fraction": {who: round(median([i for _, i in t]), 3) for who, t in times.items()},
            "params": n_params,
            "device": torch.cuda.get_device_name(),
        },
        notes=f"{n_params / 1e9:.2f}B-param GPT in bf16 ({n_layer} layers of {n_embd}), batch {BATCH} x "
        f"{config.block_size}, one local daemon (64 MiB shards); {blocks} ABBA blocks of {block_steps} steps",
        scaled_down=scaled_down,
    )


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="daemon vs torchao's CPUOffloadOptimizer on one GPU")
    parser.add_argument("--n-layer", type=int, default=N_LAYER, help=f"transformer blocks ({N_LAYER})")
    parser.add_argument("--n-embd", type=int, default=N_EMBD, help=f"width, a multiple of 16 ({N_EMBD})")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help=f"ABBA blocks, an even number ({BLOCKS})")
    parser.add_argument("--block-steps", type=int, default=BLOCK_STEPS, help=f"steps per block ({BLOCK_STEPS})")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(**vars(_parse()))
