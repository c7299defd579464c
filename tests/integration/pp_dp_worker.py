"""One rank of the pp x dp training run that tests/integration/test_pipeline_dp.py starts
with torchrun (tests/helpers/pipeline_mlp.py holds the model, its batches and loss, and the
start); dp replica 0 of each stage saves its stage's parameters at the end (with
--save-replicas every replica saves stage<s>.replica<r>.pt). With --trace every rank also
writes trace<rank>.json: its stage, its replica, torch's planned compute order for its
stage, and the compute actions it really ran, one list per step."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.trainer.pipeline.schedule_check import ScheduleRecorder, compute_order
from tests.helpers.pipeline_mlp import GLOBAL_BATCH, batches, layers, loss_fn


def inject_overflow(model: trainer.PipelineTrainer, at_step: int) -> None:
    """An inf in this rank's reduced gradients at one step (its dp peer's stay finite)."""
    finish = model.reducer.finish

    def finish_then_overflow() -> None:
        finish()
        if model.steps == at_step:
            model.optimizer.flat.grads[0] = float("inf")

    model.reducer.finish = finish_then_overflow


def kill_and_restart_before_step(model: trainer.PipelineTrainer, at_step: int, spec: str, out: Path) -> None:
    """At optimizer step `at_step` (once every rank's micro-batches are pushed): SIGKILLs the
    daemon PID and restarts it on PORT with its NVMe dir (`spec` = PID@PORT@NVME_DIR), between
    two barriers of the whole job, so the step's parts it held are gone before any rank checks.
    The restarted daemon's pid goes to out/restarted.pid for the test to stop."""
    pid, port, nvme = spec.split("@", 2)
    step = model.optimizer.step

    def killing_step(*args, **kwargs):
        if model.optimizer.step_count == at_step and not (out / "restarted.pid").exists():
            torch.distributed.barrier()
            if torch.distributed.get_rank() == 0:
                os.kill(int(pid), signal.SIGKILL)
                restarted = LocalDaemon(out / "restarted", "--nvme-dir", nvme, "--listen", f"127.0.0.1:{port}")
                (out / "restarted.pid").write_text(str(restarted.process.pid))
            torch.distributed.barrier()
        return step(*args, **kwargs)

    model.optimizer.step = killing_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--daemons", default="")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--die", default="", help="RANK@STEP: that rank exits abruptly before that step")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--max-grad-norm", type=float, default=None)
    p.add_argument("--trace", action="store_true", help="record the compute actions run into trace<rank>.json")
    p.add_argument("--dp-compression", default="none")
    p.add_argument("--compression-warmup-steps", type=int, default=0)
    p.add_argument("--save-replicas", action="store_true", help="every replica saves stage<s>.replica<r>.pt")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--overflow", default="", help="RANK@STEP: an inf in that rank's gradients at that step")
    p.add_argument("--stream", action="store_true", help="stream the Linear layers, one on the trainer at a time")
    p.add_argument("--kill-daemon", default="", help="STEP@PID@PORT@NVME_DIR: kill_and_restart_before_step")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    ctx = trainer.init_distributed(args.pp, args.dp)
    dp_compression = trainer.CompressionConfig(method=args.dp_compression, warmup_steps=args.compression_warmup_steps)
    model_layers = [layer.to(dtype) for layer in layers()]
    stream = None
    if args.stream:
        linear = [layer for layer in model_layers if isinstance(layer, torch.nn.Linear)]
        largest = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in linear)
        stream = trainer.Streaming(blocks=linear, window_bytes=largest, device=ctx.device)
    model = trainer.PipelineTrainer(
        model_layers, loss_fn, ctx=ctx, optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1), stream=stream,
        config=trainer.ParallelConfig(
            microbatches=args.microbatches, schedule=args.schedule, max_grad_norm=args.max_grad_norm,
            dp_compression=dp_compression,
        ),
        daemons=args.daemons.split(",") if args.daemons else None,
        offload=trainer.OffloadConfig(shard_bytes=4096, staleness=args.staleness),
        # (streamed: the retries outlast a daemon's restart, for --kill-daemon)
        client=trainer.ClientConfig(retry_seconds=60.0, backoff_seconds=0.25) if args.stream else None,
    )  # fmt: skip
    if args.kill_daemon:
        kill_step, _, spec = args.kill_daemon.partition("@")
        kill_and_restart_before_step(model, int(kill_step), spec, Path(args.out))
    overflow_rank, _, overflow_step = args.overflow.partition("@")
    if args.overflow and ctx.grid.rank == int(overflow_rank):  # (not with --stream: no flat gradient)
        inject_overflow(model, int(overflow_step))
    recorder = ScheduleRecorder(model.stage) if args.trace else None
    ran: list[list[tuple[str, int]]] = []
    per_replica = GLOBAL_BATCH // args.dp
    die_rank, _, die_step = args.die.partition("@")
    for step, (x, y) in enumerate(batches(args.steps)):
        if args.die and ctx.grid.rank == int(die_rank) and step == int(die_step):
            os._exit(17)  # as a crash would: no clean-up, no goodbye to the others
        mine = slice(ctx.grid.replica * per_replica, (ctx.grid.replica + 1) * per_replica)
        while True:  # as a user's loop runs a lost step again (a streamed stage's StepLost)
            try:
                model.step(x[mine].to(ctx.device, dtype), y[mine].to(ctx.device))
                break
            except trainer.StepLost as error:
                (Path(args.out) / f"lost{ctx.grid.rank}.txt").write_text(str(error))
        if recorder:
            ran.append(recorder.take())
    model.synchronize()
    if recorder:
        recorder.detach()
        planned = compute_order(model.schedule.pipeline_order)[ctx.grid.stage]
        trace = {"stage": ctx.grid.stage, "replica": ctx.grid.replica, "planned": planned, "steps": ran}
        (Path(args.out) / f"trace{ctx.grid.rank}.json").write_text(json.dumps(trace))
    if model.loss_scaler is not None:
        scaler = {"skipped": model.loss_scaler.skipped_steps, "scale": model.loss_scaler.scale,
                  "version": model.optimizer.step_count}  # fmt: skip
        (Path(args.out) / f"scaler{ctx.grid.rank}.json").write_text(json.dumps(scaler))
    if args.stream:
        stats = {**model.optimizer.stats, "version": model.optimizer.step_count}
        (Path(args.out) / f"stream{ctx.grid.rank}.json").write_text(json.dumps(stats))
    if ctx.grid.replica == 0 or args.save_replicas:
        start, _ = model.bounds[ctx.grid.stage]
        state = {
            f"{start + int(k.split('.')[0])}.{k.split('.', 1)[1]}": v for k, v in model.module.state_dict().items()
        }
        name = f"stage{ctx.grid.stage}.replica{ctx.grid.replica}" if args.save_replicas else f"stage{ctx.grid.stage}"
        torch.save(state, Path(args.out) / f"{name}.pt")
    model.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
