"""gpu_step_vs_torchao: training steps of a ~1.2B-parameter bf16 GPT on one GPU, its AdamW
through a local ps-daemon (fp32 master and state on the daemon, bf16 shards over the data
plane), against torchao's CPUOffloadOptimizer (the offload a single-GPU user would pick
instead) on the same model, batch and dtype, in the same run. Needs CUDA and torchao (`pip
install torchao` on the GPU machine); without either it says so and records nothing.

Two peers. `torchao`: CPUOffloadOptimizer on the same bf16 model, as a user would run it; it
keeps its CPU copy of each parameter, and so AdamW's state, in the parameter's dtype (bf16):
about half the bytes of our fp32 master, exp_avg and exp_avg_sq per step, and bf16 AdamW's
rounding. `torchao_fp32`: the same optimizer on an fp32 copy of the model trained under bf16
autocast, whose state is fp32 as ours (the same precision, fp32 gradients over PCIe).

Each runs in its own blocks of steps, in the order ours, torchao, torchao_fp32 and back (ABC
CBA), on its own copy of the model; ratio = median of the per-block ratios of steps per second,
ours over torchao's (the faster peer; target >= 1.0), and ratio_vs_torchao_fp32 the same against
the fp32 one.
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

from bench.common import BenchDaemon, daemon_stats, median, quick, record, spread
from ps_offload import trainer
from ps_offload.trainer.debug_models import GPTConfig, TinyGPT

N_LAYER = quick(24, 2)
N_EMBD = quick(2048, 256)
BATCH = 4
BLOCK_STEPS = quick(5, 2)
BLOCKS = quick(6, 2)


def _model(config: GPTConfig, dtype: torch.dtype = torch.bfloat16) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(config).to("cuda", dtype)


def _runner(model, opt, batch, block_steps: int, *, autocast: bool = False):
    """One block of steps; returns (seconds per step, GPU idle fraction). With autocast, the
    fp32 model's forward and backward run in bf16 (torch.autocast), as mixed precision does."""
    x, y = batch

    def run() -> tuple[float, float]:
        busy = 0.0
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(block_steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                loss = model(x, y)[1]
            loss.backward()
            end.record()
            opt.step()
            opt.zero_grad()
            end.synchronize()
            busy += begin.elapsed_time(end) / 1000
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - started) / block_steps
        return per_step, 1 - busy / block_steps / per_step

    return run


def _profile(
    who: str, model, opt, batch, daemon_address: str | None, *, autocast: bool = False, steps: int = 3
) -> dict:
    """Where a step's time goes, after the measured blocks (not in them): torch.profiler over
    `steps` steps in the training process (its table printed: the log is the profile), and for
    ours the daemon's own optimizer seconds per step from its Stats counter."""
    from torch.profiler import ProfilerActivity, profile

    def optimizer_seconds() -> float:
        return daemon_stats(daemon_address).optimizer_seconds if daemon_address else 0.0

    before = optimizer_seconds()
    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                loss = model(batch[0], batch[1])[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / steps
    daemon_step = (optimizer_seconds() - before) / steps
    print(f"===== profile of {who}'s steps =====")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    print(f"profile {who}: {wall * 1e3:.1f} ms per step (profiled), daemon optimizer "
          f"{daemon_step * 1e3:.1f} ms per step, torch threads {torch.get_num_threads()}")  # fmt: skip
    daemon = {"daemon_optimizer_ms": round(daemon_step * 1e3, 1)} if daemon_address else {}
    return {"step_ms": round(wall * 1e3, 1), **daemon}


def main(
    *,
    n_layer: int = N_LAYER,
    n_embd: int = N_EMBD,
    blocks: int = BLOCKS,
    block_steps: int = BLOCK_STEPS,
    profile: bool = False,
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
        ours_model, peer_model, fp32_model = _model(config), _model(config), _model(config, torch.float32)
        n_params = sum(p.numel() for p in ours_model.parameters())
        ours_opt = trainer.offload(
            ours_model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-4, weight_decay=0.1),
            config=trainer.OffloadConfig(shard_bytes=64 << 20),
        )  # fmt: skip
        peer_opt, fp32_opt = (
            CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, fused=True, lr=1e-4, weight_decay=0.1)
            for m in (peer_model, fp32_model)
        )
        runners = {
            "ours": _runner(ours_model, ours_opt, batch, block_steps),
            "torchao": _runner(peer_model, peer_opt, batch, block_steps),
            "torchao_fp32": _runner(fp32_model, fp32_opt, batch, block_steps, autocast=True),
        }
        for fn in runners.values():
            fn()  # warm-up
        times = {who: [] for who in runners}
        for block in range(blocks):  # ABC CBA
            order = list(runners.items())
            for who, fn in order if block % 2 == 0 else order[::-1]:
                times[who].append(fn())
        profiled = (
            {
                "ours": _profile("ours", ours_model, ours_opt, batch, daemon.address),
                "torchao": _profile("torchao", peer_model, peer_opt, batch, None),
                "torchao_fp32": _profile("torchao_fp32", fp32_model, fp32_opt, batch, None, autocast=True),
            }
            if profile
            else None
        )
        ours_opt.close()

    def paired(peer: str) -> list[float]:  # steps/s ours / theirs, block by block
        return [p[0] / o[0] for o, p in zip(times["ours"], times[peer], strict=True)]

    return record(
        "gpu_step_vs_torchao",
        ours=1 / median([t for t, _ in times["ours"]]),
        peer=1 / median([t for t, _ in times["torchao"]]),
        unit="steps/s",
        target=1.0,
        higher_is_better=True,
        ratio=median(paired("torchao")),
        extra={
            "ratio_spread": spread(paired("torchao")),
            "steps_per_s": {who: round(1 / median([t for t, _ in ts]), 4) for who, ts in times.items()},
            "ratio_vs_torchao_fp32": round(median(paired("torchao_fp32")), 3),
            "ratio_vs_torchao_fp32_spread": spread(paired("torchao_fp32")),
            "gpu_idle_fraction": {who: round(median([i for _, i in t]), 3) for who, t in times.items()},
            "params": n_params,
            "device": torch.cuda.get_device_name(),
            **({"profile": profiled} if profiled else {}),
        },
        notes=f"{n_params / 1e9:.2f}B-param GPT in bf16 ({n_layer} layers of {n_embd}), batch {BATCH} x "
        f"{config.block_size}, one local daemon (64 MiB shards); {blocks} ABC/CBA blocks of {block_steps} steps; "
        "peer: torchao on the bf16 model (its AdamW state bf16); ratio_vs_torchao_fp32: torchao on the fp32 model "
        "under bf16 autocast (state fp32, as ours)",
        scaled_down=scaled_down,
    )


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="daemon vs torchao's CPUOffloadOptimizer on one GPU")
    parser.add_argument("--n-layer", type=int, default=N_LAYER, help=f"transformer blocks ({N_LAYER})")
    parser.add_argument("--n-embd", type=int, default=N_EMBD, help=f"width, a multiple of 16 ({N_EMBD})")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help=f"ABBA blocks, an even number ({BLOCKS})")
    parser.add_argument("--block-steps", type=int, default=BLOCK_STEPS, help=f"steps per block ({BLOCK_STEPS})")
    parser.add_argument("--profile", action="store_true", help="after the blocks, profile 3 steps of each (printed)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(**vars(_parse()))
