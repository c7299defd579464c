"""Pipeline stages x data-parallel replicas under torchrun, with the optimizer on the daemons.

    torchrun --nproc-per-node 4 train.py        # in train.py:
    ctx = trainer.parallel.init_distributed(pp=2, dp=2)
    model = trainer.PipelineTrainer(layers, loss_fn, ctx=ctx, microbatches=4, daemons=[...],
                                    optimizer=trainer.AdamW(lr=3e-4))
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
whole global batch. `dp_compression="onebit"` (or "bf16", "fp16", "topk" with
`dp_topk_ratio`) compresses that all-reduce both ways with error feedback
(trainer/compressed_allreduce.py), after `compression_warmup_steps` plain steps.

With daemons, each stage is a model of its own on them (`<model_name>.stage<i>`); the dp
ranks of a stage push every dp-th shard each (`push_share`), and every rank pulls all of
its stage's shards at version step + 1. Without daemons the stage runs torch's fused AdamW
in-process (the baseline the daemons are measured against).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ps_offload.trainer.compressed_allreduce import METHODS as DP_COMPRESSION
from ps_offload.trainer.compressed_allreduce import CompressedAllReduce
from ps_offload.trainer.config import SGD, AdamW, ClientConfig
from ps_offload.trainer.offload import OffloadOptimizer

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
BUCKET_BYTES = 25 << 20
FIRST_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class RankGrid:
    """Where a rank sits: stage = rank // dp, replica = rank % dp."""

    pp: int
    dp: int
    rank: int

    def __post_init__(self) -> None:
        if self.pp < 1 or self.dp < 1:
            raise ValueError(f"pp and dp must be at least 1, got pp={self.pp}, dp={self.dp}")
        if not 0 <= self.rank < self.pp * self.dp:
            raise ValueError(f"rank {self.rank} is outside a grid of pp={self.pp} x dp={self.dp}")

    @property
    def stage(self) -> int:
        return self.rank // self.dp

    @property
    def replica(self) -> int:
        return self.rank % self.dp

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1


@dataclass
class ParallelContext:
    grid: RankGrid
    pp_group: dist.ProcessGroup  # this replica's stages
    dp_group: dist.ProcessGroup  # this stage's replicas
    device: torch.device


def init_distributed(pp: int, dp: int) -> ParallelContext:
    """Joins torchrun's process group (NCCL with CUDA, gloo otherwise) and builds the grid."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if pp * dp != world:
        raise ValueError(f"pp x dp = {pp} x {dp} = {pp * dp}, but torchrun started {world} processes")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    grid = RankGrid(pp, dp, dist.get_rank())
    return ParallelContext(grid, mesh["pp"].get_group(), mesh["dp"].get_group(), device)


def split_layers(sizes: Sequence[int], stages: int, *, by: str = "params") -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, one per stage, every stage non-empty.

    by="params": the split whose largest stage has the fewest parameters (ties: the earliest
    such split); by="uniform": layer counts as equal as possible (DeepSpeed's two methods)."""
    n = len(sizes)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    if by == "uniform":
        bounds = [round(i * n / stages) for i in range(stages + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))
    if by != "params":
        raise ValueError(f'split must be "params" or "uniform", got {by!r}')
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest possible largest stage for the first i layers in k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges, end = [], n
    for k in range(stages, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


class GradReducer:
    """Sums a stage's gradients over its dp group in buckets that start during backward.

    `params` lie in `flat_grads` in order, so a bucket is a contiguous range of it. Buckets
    are formed from the end (backward produces the last layers' gradients first), the first
    one small so the network starts early. `hook(bucket, group)` replaces the plain
    all-reduce (the place compression plugs in); it must leave the sum in `bucket` and may
    return a work handle to wait on."""

    def __init__(
        self,
        params: list[nn.Parameter],
        flat_grads: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        microbatches: int,
        bucket_bytes: int = BUCKET_BYTES,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        hook: Callable[[torch.Tensor, dist.ProcessGroup], object] | None = None,
    ) -> None:
        self.flat_grads = flat_grads
        self.group = group
        self.world = dist.get_world_size(group)
        self.microbatches = microbatches
        self.hook = hook
        offsets, at = [], 0
        for p in params:
            offsets.append(at)
            at += p.numel()
        self.buckets: list[tuple[int, int, list[int]]] = []  # (lo, hi, param indices)
        limit, members, hi = first_bucket_bytes, [], at
        for index in range(len(params) - 1, -1, -1):
            members.append(index)
            lo = offsets[index]
            if (hi - lo) * 4 >= limit or index == 0:
                self.buckets.append((lo, hi, members))
                limit, members, hi = bucket_bytes, [], lo
        self._bucket_of = {i: b for b, (_, _, members) in enumerate(self.buckets) for i in members}
        self._params = params
        self._views = [flat_grads[o : o + p.numel()].view_as(p) for o, p in zip(offsets, params, strict=True)]
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(params)]
        self.start_step()

    def start_step(self) -> None:
        self._counts = [0] * len(self._params)
        self._ready = [0] * len(self.buckets)
        self._works: dict[int, object] = {}

    def _hook_for(self, index: int):
        def on_grad(param: nn.Parameter) -> None:
            if param.grad.data_ptr() != self._views[index].data_ptr():
                # Autograd made a new tensor (e.g. after zero_grad(set_to_none=True)).
                self._views[index].copy_(param.grad)
                param.grad = self._views[index]
            self._counts[index] += 1
            if self._counts[index] == self.microbatches:
                bucket = self._bucket_of[index]
                self._ready[bucket] += 1
                if self._ready[bucket] == len(self.buckets[bucket][2]):
                    self._launch(bucket)

        return on_grad

    def _launch(self, bucket: int) -> None:
        lo, hi, _ = self.buckets[bucket]
        view = self.flat_grads[lo:hi]
        if self.hook is not None:
            self._works[bucket] = self.hook(view, self.group)
        else:
            self._works[bucket] = dist.all_reduce(view, group=self.group, async_op=True)

    def finish(self) -> None:
        """Reduces what backward did not start (parameters without gradients this step),
        waits for every bucket, and turns the sum into the mean over the global batch."""
        for bucket in range(len(self.buckets)):
            if bucket not in self._works:
                self._launch(bucket)
        for work in self._works.values():
            if work is not None:
                work.wait()
        self.flat_grads.div_(self.world * self.microbatches)
        self.start_step()

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()


def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """Points every parameter's .grad into one flat buffer, in order (in-process optimizer)."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    at = 0
    for p in params:
        p.grad = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    return flat


class PipelineTrainer:
    """This rank's stage, its schedule, its gradient reduction and its optimizer."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        ctx: ParallelContext,
        microbatches: int,
        optimizer: AdamW | SGD,
        schedule: str = "1f1b",
        split: str = "params",
        daemons: list[str] | None = None,
        model_name: str = "model",
        shard_bytes: int = 0,
        no_weight_decay: Callable[[str, nn.Parameter], bool] | None = None,
        client_config: ClientConfig | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        reduce_hook: Callable[[torch.Tensor, dist.ProcessGroup], object] | None = None,
        staleness: int = 0,
        max_grad_norm: float | None = None,
        dp_compression: str = "none",
        compression_warmup_steps: int = 0,
        dp_topk_ratio: float = 0.01,
    ) -> None:
        if dp_compression not in DP_COMPRESSION:
            raise ValueError(f"dp_compression must be one of {list(DP_COMPRESSION)}, got {dp_compression!r}")
        if dp_compression != "none" and reduce_hook is not None:
            raise ValueError(f"give reduce_hook or dp_compression={dp_compression!r}, not both")
        if not isinstance(compression_warmup_steps, int) or compression_warmup_steps < 0:
            raise ValueError(f"compression_warmup_steps must be an int >= 0, got {compression_warmup_steps!r}")
        if compression_warmup_steps and dp_compression == "none":
            raise ValueError("compression_warmup_steps counts the plain steps before dp_compression starts; "
                             "it needs a dp_compression other than none")  # fmt: skip
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        grid = ctx.grid
        if microbatches < grid.pp and schedule == "1f1b":
            raise ValueError(f"1F1B needs at least as many micro-batches as stages ({grid.pp}), got {microbatches}")
        if staleness and not daemons:
            raise ValueError("staleness=1 (delayed update) needs daemons: the in-process optimizer has no delay")
        self.ctx = ctx
        self.max_grad_norm = max_grad_norm
        self.steps = 0  # optimizer steps taken
        # The compressed all-reduce (with its error feedback state) replaces the plain one
        # after the warm-up steps, as 1-bit Adam runs its first steps uncompressed.
        self.compression: CompressedAllReduce | None = None
        self.compression_warmup_steps = compression_warmup_steps
        if dp_compression != "none":
            self.compression = CompressedAllReduce(dp_compression, topk_ratio=dp_topk_ratio)
            reduce_hook = self.compression
        self.grad_norm: float | None = None  # the last step's, before clipping (when clipping)
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        self.bounds = split_layers(sizes, grid.pp, by=split)
        start, end = self.bounds[grid.stage]
        self.module = nn.Sequential(*layers[start:end]).to(ctx.device)
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.offload: OffloadOptimizer | None = None
        if daemons:
            self.offload = self._offload(
                daemons, optimizer, model_name, shard_bytes, no_weight_decay, client_config, staleness
            )
            params, flat = self.offload.params, self.offload.flat_grads
            self.local = None
        else:
            flat = _flat_grads(params)
            self.local = _local_optimizer(self.module, optimizer, no_weight_decay)
        self.reducer = GradReducer(
            params, flat, ctx.dp_group, microbatches=microbatches, bucket_bytes=bucket_bytes, hook=reduce_hook
        )
        self.stage = PipelineStage(self.module, grid.stage, grid.pp, ctx.device, group=ctx.pp_group)
        # Unscaled: the reducer divides once, by dp x micro-batches, after the sum.
        self.schedule = SCHEDULES[schedule](self.stage, microbatches, loss_fn=loss_fn, scale_grads=False)

    def _offload(self, daemons, optimizer, model_name, shard_bytes, no_weight_decay, client_config, staleness):
        grid = self.ctx.grid
        barrier = None
        if staleness and grid.dp > 1:
            # Under the delayed update a replica's pulls of step t run during step t+1; no
            # replica may push step t+1 (making version t+2) before all have pulled step t.
            def barrier() -> None:
                dist.barrier(group=self.ctx.dp_group)

        kwargs = dict(
            daemons=daemons,
            optimizer=optimizer,
            model_name=f"{model_name}.stage{grid.stage}",
            shard_bytes=shard_bytes,
            no_weight_decay=no_weight_decay,
            config=client_config,
            push_share=(grid.replica, grid.dp),
            staleness=staleness,
            before_push=barrier,
        )
        # Replica 0 registers the stage and pushes its initial values; the others then find
        # the model known and take those values (so every replica starts equal).
        offload = OffloadOptimizer(self.module, **kwargs) if grid.replica == 0 else None
        dist.barrier(group=self.ctx.dp_group)
        return offload or OffloadOptimizer(self.module, **kwargs)

    @property
    def lr(self) -> float:
        return self.offload.lr if self.offload else self.local.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        if self.offload:
            self.offload.lr = value
        else:
            for group in self.local.param_groups:
                group["lr"] = value

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> float | None:
        """One optimizer step over a global batch: this replica's `inputs` (first stage) and
        `targets` (last stage), split into micro-batches. Returns the mean micro-batch loss
        on the last stage, None elsewhere."""
        grid = self.ctx.grid
        if self.compression:
            self.compression.enabled = self.steps >= self.compression_warmup_steps
        if self.offload:
            self.offload.zero_grad()
        else:
            self.reducer.flat_grads.zero_()
        losses: list[torch.Tensor] = []
        args = (inputs,) if grid.first_stage else ()
        if grid.last_stage:
            self.schedule.step(*args, target=targets, losses=losses)
        else:
            self.schedule.step(*args)
        self.reducer.finish()
        if self.max_grad_norm is not None:
            self._clip_grad_norm()
        if self.offload:
            self.offload.step()
        else:
            self.local.step()
        self.steps += 1
        return float(torch.stack(losses).mean()) if losses else None

    def _clip_grad_norm(self) -> None:
        """torch.nn.utils.clip_grad_norm_ over the whole model: every replica of a stage
        holds the same reduced gradients, so the squared norms of one replica's stages sum
        over the pp group to the model's."""
        flat = self.reducer.flat_grads
        squared = flat.double().pow(2).sum().reshape(1)
        dist.all_reduce(squared, group=self.ctx.pp_group)
        norm = float(squared.sqrt())
        self.grad_norm = norm
        scale = self.max_grad_norm / (norm + 1e-6)
        if scale < 1.0:
            flat.mul_(scale)

    def synchronize(self) -> None:
        if self.offload:
            self.offload.synchronize()

    def close(self) -> None:
        self.reducer.close()
        if self.compression:
            self.compression.close()
        if self.offload:
            self.offload.close()


def _local_optimizer(module: nn.Module, optimizer: AdamW | SGD, no_weight_decay) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if not (no_weight_decay and no_weight_decay(n, p))]
    other = [p for n, p in named if no_weight_decay and no_weight_decay(n, p)]
    groups = [{"params": decay, "weight_decay": optimizer.weight_decay}]
    if other:
        groups.append({"params": other, "weight_decay": 0.0})
    if isinstance(optimizer, AdamW):
        return torch.optim.AdamW(groups, lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps, fused=True)
    return torch.optim.SGD(
        groups, lr=optimizer.lr, momentum=optimizer.momentum, dampening=optimizer.dampening,
        nesterov=optimizer.nesterov, fused=True,
    )  # fmt: skip
