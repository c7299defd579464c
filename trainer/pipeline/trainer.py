"""Pipeline stages x data-parallel replicas under torchrun, with the optimizer on the daemons.

    torchrun --nproc-per-node 4 train.py        # in train.py:
    ctx = trainer.init_distributed(pp=2, dp=2)
    model = trainer.PipelineTrainer(layers, loss_fn, ctx=ctx, optimizer=trainer.AdamW(lr=3e-4),
                                    config=trainer.ParallelConfig(microbatches=4), daemons=[...])
    loss = model.step(inputs, targets)          # inputs on the first stage, targets on the last

Ranks form a pp x dp grid (torchtitan's order: rank = stage * dp + replica), as a DeviceMesh
with dimensions ("pp", "dp"). Each rank builds only its stage: a contiguous run of the
layers, split by parameter count (default) or by number of layers. Micro-batches flow
through torch.distributed.pipelining's GPipe or 1F1B schedule over the replica's pp group.

Gradients: the schedule accumulates them over the micro-batches into the stage's flat
gradient buffer (unscaled); `GradReducer` sums them over the stage's dp group in buckets,
each started by a post-accumulate hook as soon as the last micro-batch's backward has
produced every gradient in it, so the reduction overlaps the rest of backward. The sum is
then divided by dp x micro-batches, which gives the gradient of the mean loss over the
whole global batch. `ParallelConfig.dp_compression` (a CompressionConfig: "onebit", "bf16",
"fp16" or "topk") compresses that all-reduce both ways with error feedback
(trainer/pipeline/compressed_allreduce.py), after its `warmup_steps` plain steps.

With daemons, each stage is a model of its own on them (`<model_name>.stage<i>`); the dp
ranks of a stage push every dp-th shard each (`push_share`), and every rank pulls all of
its stage's shards at version step + 1. Without daemons the stage runs torch's fused AdamW
in-process (the baseline the daemons are measured against). Both are a StepOptimizer
(trainer/pipeline/local_optimizer.py) over the stage's FlatParams (trainer/io/flat.py), so the step is one path.

Streamed stages (`stream=Streaming(blocks=..., window_bytes=...)`): each stage's optimizer
is a StreamedOptimizer (trainer/stream/optimizer.py) over its share of the blocks, so a stage need
not fit its rank. There is no flat gradient and no GradReducer: each micro-batch's backward
all-reduces a block's gradient over the dp group as the block completes, each replica pushes
its share of the block's shards as that micro-batch's part, the daemons sum the parts in
fp32, and the APPLY scales the sum by 1 / (dp x micro-batches).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ps_offload.trainer.config import ClientConfig, OffloadConfig, OptimizerConfig, ParallelConfig, expect_config
from ps_offload.trainer.offload.whole_model import OffloadOptimizer
from ps_offload.trainer.pipeline.compressed_allreduce import CompressedAllReduce
from ps_offload.trainer.pipeline.grid import ParallelContext, split_layers
from ps_offload.trainer.pipeline.local_optimizer import LocalOptimizer, StepOptimizer
from ps_offload.trainer.pipeline.reducer import GradReducer
from ps_offload.trainer.pipeline.schedule_check import check_planned_schedule
from ps_offload.trainer.stream.optimizer import StreamedOptimizer
from ps_offload.trainer.stream.settings import Streaming, check_stage_streaming

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class PipelineTrainer:
    """This rank's stage, its schedule, its gradient reduction and its optimizer.

    The optimizer is a StepOptimizer (trainer/pipeline/local_optimizer.py): the daemons' (OffloadOptimizer) when
    `daemons` are given, torch's fused one in process (LocalOptimizer) otherwise; the step
    is the same for both."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        ctx: ParallelContext,
        optimizer: OptimizerConfig,
        config: ParallelConfig | None = None,
        daemons: list[str] | None = None,
        no_weight_decay: Callable[[str, nn.Parameter], bool] | None = None,
        offload: OffloadConfig | None = None,
        client: ClientConfig | None = None,
        reduce_hook: Callable[[torch.Tensor, dist.ProcessGroup], object] | None = None,
        stream: Streaming | None = None,
    ) -> None:
        """daemons: None or [] runs the optimizer in process (then `offload` and `client`
        are not used, and staleness=1 is refused). reduce_hook(bucket, group): replaces the
        plain dp all-reduce (see GradReducer); not together with `config.dp_compression`.
        stream: the stage streams its share of `stream.blocks` (see the module docstring)."""
        config = expect_config(config, ParallelConfig, "config")
        offload = expect_config(offload, OffloadConfig, "offload")
        client = expect_config(client, ClientConfig, "client")
        if stream is not None:
            check_stage_streaming(stream, config, daemons, offload, reduce_hook)
        if offload.push_share != (0, 1):
            raise ValueError("PipelineTrainer sets push_share from the grid; leave OffloadConfig.push_share out")
        if offload.push_in_backward:
            raise ValueError(
                "OffloadConfig.push_in_backward is for offload(): a PipelineTrainer pushes the dp-reduced gradients"
            )
        if offload.staleness and not daemons:
            raise ValueError("staleness=1 (delayed update) needs daemons: the in-process optimizer has no delay")
        dp_compression = config.dp_compression
        if dp_compression.enabled and reduce_hook is not None:
            raise ValueError(f"give reduce_hook or dp_compression={dp_compression.method!r}, not both")
        grid = ctx.grid
        if config.microbatches < grid.pp and config.schedule == "1f1b":
            raise ValueError(
                f"1F1B needs at least as many micro-batches as stages ({grid.pp}), got {config.microbatches}: "
                "raise ParallelConfig.microbatches or use schedule='gpipe'"
            )
        self.ctx = ctx
        self.config = config
        self.max_grad_norm = config.max_grad_norm
        self.steps = 0  # optimizer steps taken
        # The compressed all-reduce (with its error feedback state) replaces the plain one
        # after the warm-up steps, as 1-bit Adam runs its first steps uncompressed.
        self.compression: CompressedAllReduce | None = None
        if dp_compression.enabled:
            self.compression = CompressedAllReduce(dp_compression.method, topk_ratio=dp_compression.topk_ratio)
            reduce_hook = self.compression
        self.grad_norm: float | None = None  # the last step's, before clipping (when clipping)
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        self.bounds = split_layers(sizes, grid.pp, by=config.split)
        start, end = self.bounds[grid.stage]
        self.module = nn.Sequential(*layers[start:end])  # in the layers' own dtype
        if stream is None:
            self.module.to(ctx.device)  # (a streamed stage's units are placed, or made, by its optimizer)
        half = {p.dtype for p in self.module.parameters()} & {torch.bfloat16, torch.float16}
        if half and not daemons:
            raise ValueError(
                f"a {half.pop()} stage needs daemons: they keep the fp32 master values (in process there is none)"
            )
        self.optimizer: StepOptimizer
        self.reducer: GradReducer | None = None  # a streamed stage reduces each block as it is pushed
        if stream is not None:
            self.optimizer = self._offload(daemons, optimizer, no_weight_decay, offload, client, stream)
        elif daemons:
            self.optimizer = self._offload(daemons, optimizer, no_weight_decay, offload, client)
        else:
            self.optimizer = LocalOptimizer(self.module, optimizer=optimizer, no_weight_decay=no_weight_decay)
        if stream is None:
            self.reducer = GradReducer(
                self.optimizer.flat, ctx.dp_group, microbatches=config.microbatches, bucket_bytes=config.bucket_bytes,
                first_bucket_bytes=config.first_bucket_bytes, hook=reduce_hook,
            )  # fmt: skip
        self.stage = PipelineStage(self.module, grid.stage, grid.pp, ctx.device, group=ctx.pp_group)
        # Unscaled: the reducer divides once, by dp x micro-batches, after the sum.
        self.loss_scaler = getattr(self.optimizer, "loss_scaler", None)  # fp16 stages
        if self.loss_scaler is not None:
            unscaled = loss_fn

            def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                return self.loss_scaler.scale_loss(unscaled(output, target))

        self.schedule = SCHEDULES[config.schedule](self.stage, config.microbatches, loss_fn=loss_fn, scale_grads=False)
        # A wrong order hangs or overruns memory instead of failing where it is wrong: check
        # the plan before the first step runs it.
        check_planned_schedule(self.schedule, stages=grid.pp, microbatches=config.microbatches, name=config.schedule)

    def _offload(
        self, daemons, optimizer, no_weight_decay, offload: OffloadConfig, client: ClientConfig, stream=None
    ) -> OffloadOptimizer | StreamedOptimizer:
        grid = self.ctx.grid
        barrier = None
        if offload.staleness and grid.dp > 1:
            # Under the delayed update a replica's pulls of step t run during step t+1; no
            # replica may push step t+1 (making version t+2) before all have pulled step t.
            def barrier() -> None:
                dist.barrier(group=self.ctx.dp_group)

        stage_config = replace(
            offload, model_name=f"{offload.model_name}.stage{grid.stage}", push_share=(grid.replica, grid.dp)
        )
        kwargs = dict(
            daemons=daemons, optimizer=optimizer, no_weight_decay=no_weight_decay, config=stage_config,
            client=client, any_rank=self._any_rank,
        )  # fmt: skip
        if stream is None:
            make = functools.partial(OffloadOptimizer, self.module, before_push=barrier, **kwargs)
        else:
            mine = {id(m) for m in self.module.modules()}
            blocks = [b for b in stream.blocks if id(b) in mine]
            if not blocks:
                raise ValueError(
                    f"stage {grid.stage} (layers {self.bounds[grid.stage]}) holds none of Streaming.blocks: "
                    "every stage streams at least one block; use fewer stages or split the layers otherwise"
                )
            group, dp, micro = self.ctx.dp_group, grid.dp, self.config.microbatches
            make = functools.partial(
                StreamedOptimizer, self.module,
                replace(stream, blocks=blocks, device=stream.device or self.ctx.device), **kwargs,
                reduce_gradient=(lambda buffer: dist.all_reduce(buffer, group=group)) if dp > 1 else None,
                gradient_scale=1.0 / (dp * micro),
            )  # fmt: skip
        # Replica 0 registers the stage and pushes its initial values; the others then find
        # the model known and take those values (so every replica starts equal).
        first = make() if grid.replica == 0 else None
        dist.barrier(group=self.ctx.dp_group)
        return first or make()

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank of the job: an fp16 overflow on one rank skips the
        step on every rank (each stage's replicas and every other stage), as GradScaler's
        found_inf does across a job."""
        found = torch.tensor([float(flag)], device=self.ctx.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.lr = value

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> float | None:
        """One optimizer step over a global batch: this replica's `inputs` (first stage) and
        `targets` (last stage), split into micro-batches. Returns the mean micro-batch loss
        on the last stage, None elsewhere."""
        grid = self.ctx.grid
        if self.compression:
            self.compression.enabled = self.steps >= self.config.dp_compression.warmup_steps
        self.optimizer.zero_grad(set_to_none=False)  # the reducer works in the flat buffer (a streamed stage: none)
        losses: list[torch.Tensor] = []
        args = (inputs,) if grid.first_stage else ()
        if grid.last_stage:
            self.schedule.step(*args, target=targets, losses=losses)
        else:
            self.schedule.step(*args)
        if self.reducer is not None:
            self.reducer.finish()
        if self.max_grad_norm is not None:
            self._clip_grad_norm()
        scale = self.loss_scaler.scale if self.loss_scaler else 1.0  # before step() moves it
        self.optimizer.step()
        self.steps += 1
        return float(torch.stack(losses).float().mean()) / scale if losses else None

    def _clip_grad_norm(self) -> None:
        """torch.nn.utils.clip_grad_norm_ over the whole model: every replica of a stage
        holds the same reduced gradients, so the squared norms of one replica's stages sum
        over the pp group to the model's."""
        flat = self.optimizer.flat.grads
        squared = flat.double().pow(2).sum().reshape(1)
        dist.all_reduce(squared, group=self.ctx.pp_group)
        # fp16 gradients are still loss-scaled here (the daemons unscale): the norm is not.
        norm = float(squared.sqrt()) / (self.loss_scaler.scale if self.loss_scaler else 1.0)
        self.grad_norm = norm
        scale = self.max_grad_norm / (norm + 1e-6)
        if scale < 1.0:
            flat.mul_(scale)

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.close()
        if self.compression:
            self.compression.close()
        self.optimizer.close()
