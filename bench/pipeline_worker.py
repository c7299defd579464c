"""One rank of the pipeline benchmarks, started by torchrun; rank 0 writes a JSON to --out.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.pipeline_worker \\
        efficiency --out r.json                                 # bench/pipeline_efficiency.py
    python -m torch.distributed.run --standalone --nproc-per-node 4 -m bench.pipeline_worker \\
        overhead --pp 2 --dp 2 --daemons A,B --out r.json       # bench/ps_overhead_pp_dp.py

Every rank runs torch on one thread (the machines these run on have 2 cores).

`efficiency` (pp=2, dp=1, in-process fused AdamW): one PipelineTrainer per (schedule,
micro-batches); in each round every configuration runs --steps timed steps (the order
reversed every other round), then each rank times its stage's forward + backward of one
micro-batch alone (a separate copy of the stage, no communication, the same shapes; the first
stage's backward from a fixed output gradient, the last stage's through the loss) and the
stage's fused AdamW step alone. The timed region of a pipeline step is the whole
`PipelineTrainer.step()`, optimizer included, so the ideal adds the slowest stage's optimizer
step: ideal = (m + p - 1) * max_stage(t_mb) + max_stage(t_opt). Each stage's forward and
backward chunks are also timed inside the pipeline steps (`ComputeClock`), which tells a
pipeline that waits from one whose compute runs slower than alone.

`overhead`: a pp x dp run of the GPT with one PipelineTrainer per variant in the same
processes: `in_process` (torch's fused AdamW), `daemons`, `staleness1` (daemons, delayed
update). After --warmup steps each, blocks alternate between the variants (ABC CBA ...): a
block is one untimed lead-in step, --steps timed steps, then synchronize() (untimed). A step's
time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ps_offload import trainer
from ps_offload.trainer.debug_models import GPTConfig, gpt_layers, gpt_loss
from ps_offload.trainer.pipeline.grid import init_distributed
from ps_offload.trainer.pipeline.trainer import PipelineTrainer

REPO = Path(__file__).resolve().parents[1]


def launch(nproc: int, *args: str, timeout: float = 600) -> dict:
    """Runs this worker under torchrun with `nproc` processes; returns what rank 0 wrote."""
    with tempfile.TemporaryDirectory(prefix="ps-bench-pp-") as tmp:
        out = Path(tmp) / "result.json"
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
             "-m", "bench.pipeline_worker", *args, "--out", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"torchrun {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return json.loads(out.read_text())


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)


def _layers(config: GPTConfig) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return gpt_layers(config)


def _batch(config: GPTConfig, sequences: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(config.vocab_size, (sequences, config.block_size), generator=g)
    y = torch.randint(config.vocab_size, (sequences, config.block_size), generator=g)
    return x, y


def _gather(value: float) -> list[float]:
    out: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return [float(v) for v in out]


def _timed_steps(model: PipelineTrainer, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    grid = model.ctx.grid
    inputs = x if grid.first_stage else None
    targets = y if grid.last_stage else None
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model.step(inputs, targets)
        times.append(time.perf_counter() - started)
    return times


class ComputeClock:
    """Wall time inside this stage's forward and backward chunks during the pipeline steps
    (a wrapper on the stage object's two methods): the per-micro-batch compute as the
    pipeline runs it, next to the one measured alone."""

    def __init__(self, model: PipelineTrainer) -> None:
        self.seconds, self.chunks = 0.0, 0
        stage = model.stage
        for name in ("forward_one_chunk", "backward_one_chunk"):
            setattr(stage, name, self._wrap(getattr(stage, name), count=name.startswith("forward")))

    def _wrap(self, method, *, count: bool):
        def timed_chunk(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.chunks += count

        return timed_chunk

    def reset(self) -> None:
        self.seconds, self.chunks = 0.0, 0


class StageAlone:
    """This rank's stage on its own: forward + backward of one micro-batch, and its optimizer."""

    def __init__(self, config: GPTConfig, bounds: tuple[int, int], *, first: bool, last: bool, mb_size: int):
        lo, hi = bounds
        self.module = torch.nn.Sequential(*_layers(config)[lo:hi])
        self.first, self.last = first, last
        g = torch.Generator().manual_seed(7)
        shape = (mb_size, config.block_size, config.n_embd)
        if first:
            self.x = torch.randint(config.vocab_size, (mb_size, config.block_size), generator=g)
        else:
            self.x = torch.randn(shape, generator=g).requires_grad_(True)  # as received: grad goes back
        self.y = torch.randint(config.vocab_size, (mb_size, config.block_size), generator=g)
        self.out_grad = None if last else torch.randn(shape, generator=g) * 1e-3
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def forward_backward(self) -> float:
        started = time.perf_counter()
        out = self.module(self.x)
        if self.last:
            gpt_loss(out, self.y).backward()
        else:
            out.backward(self.out_grad)
        return time.perf_counter() - started

    def optimizer_step(self) -> float:
        started = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - started


def efficiency(args: argparse.Namespace) -> None:
    ctx = init_distributed(args.pp, 1)
    grid = ctx.grid
    config = _config(args)
    schedules = args.schedules.split(",")
    microbatches = [int(m) for m in args.microbatches.split(",")]
    runs = {}
    for schedule in schedules:
        for m in microbatches:
            model = PipelineTrainer(
                _layers(config), gpt_loss, ctx=ctx, optimizer=trainer.AdamW(lr=1e-4, weight_decay=0.1),
                config=trainer.ParallelConfig(microbatches=m, schedule=schedule, split="params"),
            )  # fmt: skip
            runs[(schedule, m)] = (model, *_batch(config, m * args.mb_size, seed=m))
    bounds = next(iter(runs.values()))[0].bounds
    alone = StageAlone(config, bounds[grid.stage], first=grid.first_stage, last=grid.last_stage, mb_size=args.mb_size)

    for model, x, y in runs.values():
        _timed_steps(model, x, y, args.warmup)
    clocks = {key: ComputeClock(model) for key, (model, _, _) in runs.items()}
    for _ in range(args.warmup):
        alone.forward_backward(), alone.optimizer_step()

    step_times: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    mb_times: list[float] = []
    opt_times: list[float] = []
    keys = list(runs)
    for round_ in range(args.rounds):
        for key in keys if round_ % 2 == 0 else keys[::-1]:
            model, x, y = runs[key]
            dist.barrier()
            step_times[key] += _timed_steps(model, x, y, args.steps)
        dist.barrier()  # both stages compute alone at the same time, as they do in the pipeline
        mb_times += [alone.forward_backward() for _ in range(args.mb_reps)]
        opt_times += [alone.optimizer_step() for _ in range(args.mb_reps)]

    t_mb = _gather(statistics.median(mb_times))  # per stage
    t_opt = _gather(statistics.median(opt_times))
    per_rank_steps = {key: _gather(statistics.median(times)) for key, times in step_times.items()}
    in_pipeline = {key: _gather(clock.seconds / clock.chunks) for key, clock in clocks.items()}
    p, t_max, opt_max = args.pp, max(t_mb), max(t_opt)
    results = []
    for (schedule, m), steps in per_rank_steps.items():
        measured = max(steps)
        ideal = (m + p - 1) * t_max + opt_max
        results.append({
            "schedule": schedule, "microbatches": m,
            "measured_ms": 1000 * measured, "ideal_ms": 1000 * ideal, "efficiency": ideal / measured,
            # Of the pipeline's part of the step (the step less the optimizer, which runs after
            # the flush), the fraction the slowest stage is not computing.
            "bubble_measured": 1 - m * t_max / (measured - opt_max),
            "bubble_theory": (p - 1) / (m + p - 1),
            "per_rank_step_ms": [1000 * s for s in steps],
            "t_mb_in_pipeline_ms": [1000 * t for t in in_pipeline[(schedule, m)]],
            # The same ideal from the compute per micro-batch as the pipeline ran it: what the
            # schedule itself loses, apart from its compute running slower than alone.
            "efficiency_vs_in_pipeline_compute": ((m + p - 1) * max(in_pipeline[(schedule, m)]) + opt_max) / measured,
        })  # fmt: skip
    if grid.rank == 0:
        sizes = [sum(q.numel() for q in layer.parameters()) for layer in _layers(config)]
        stage_params = [sum(sizes[lo:hi]) for lo, hi in bounds]
        out = {
            "pp": p, "config": vars(config), "mb_size": args.mb_size, "params": sum(sizes),
            "stage_params": stage_params, "bounds": bounds,
            "t_mb_ms": [1000 * t for t in t_mb], "t_opt_ms": [1000 * t for t in t_opt],
            "rounds": args.rounds, "steps_per_round": args.steps, "mb_reps_per_round": args.mb_reps,
            "results": results,
        }  # fmt: skip
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for model, _, _ in runs.values():
        model.close()
    dist.destroy_process_group()


def overhead(args: argparse.Namespace) -> None:
    ctx = init_distributed(args.pp, args.dp)
    grid = ctx.grid
    config = _config(args)
    daemons = args.daemons.split(",") if args.daemons else None
    variants = args.variants.split(",")
    trainers = {}
    for variant in variants:
        offloaded = variant != "in_process"
        trainers[variant] = PipelineTrainer(
            _layers(config), gpt_loss, ctx=ctx, optimizer=trainer.AdamW(lr=1e-4, weight_decay=0.1),
            config=trainer.ParallelConfig(
                microbatches=args.microbatches, schedule=args.schedule, max_grad_norm=args.max_grad_norm
            ),
            daemons=daemons if offloaded else None,
            offload=trainer.OffloadConfig(
                model_name=f"{args.model_name}.{variant}", shard_bytes=args.shard_bytes,
                staleness=int(variant == "staleness1"),
            ),
        )  # fmt: skip
    x, y = _batch(config, args.microbatches * args.mb_size, seed=grid.replica)
    for model in trainers.values():
        _timed_steps(model, x, y, args.warmup)
        model.synchronize()
    # times[variant][block] = this rank's step times in that block
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    for block in range(args.blocks):
        for variant in variants if block % 2 == 0 else variants[::-1]:
            model = trainers[variant]
            dist.barrier()
            # One lead-in step, untimed: each timed step then also waits for the pulls of the
            # step before it, as in a long run. The block's last pulls land in synchronize().
            _timed_steps(model, x, y, 1)
            times[variant].append(_timed_steps(model, x, y, args.steps))
            model.synchronize()
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    if grid.rank == 0:
        # A step's time: the slowest rank's (the ranks of a pipeline step are coupled).
        steps = {
            v: [[max(rank[v][b][i] for rank in everyone) for i in range(args.steps)] for b in range(args.blocks)]
            for v in variants
        }
        sizes = [sum(q.numel() for q in layer.parameters()) for layer in _layers(config)]
        first = next((m for m in trainers.values() if isinstance(m.optimizer, trainer.OffloadOptimizer)), None)
        out = {
            "step_ms": {v: 1000 * statistics.median(t for b in steps[v] for t in b) for v in variants},
            "block_median_ms": {v: [1000 * statistics.median(b) for b in steps[v]] for v in variants},
            "params": sum(sizes), "shards_per_stage": len(first.optimizer.plan) if first else 0,
            "blocks": args.blocks, "steps_per_block": args.steps,
        }  # fmt: skip
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for model in trainers.values():
        model.close()
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["efficiency", "overhead"])
    p.add_argument("--out", required=True)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--mb-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    # efficiency
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--microbatches", default="2,4,8", help="efficiency: a list; overhead: one number")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--mb-reps", type=int, default=20)
    # overhead
    p.add_argument("--variants", default="in_process,daemons,staleness1")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--daemons", default="")
    p.add_argument("--shard-bytes", type=int, default=2 << 20)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--model-name", default="bench")
    args = p.parse_args()
    if args.mode == "efficiency":
        efficiency(args)
    else:
        args.microbatches = int(args.microbatches)
        overhead(args)


if __name__ == "__main__":
    main()
