"""Where a rank sits in the pp x dp grid under torchrun, and how layers split into stages.

Ranks form a pp x dp grid (torchtitan's order: rank = stage * dp + replica), as a DeviceMesh
with dimensions ("pp", "dp"); ps_offload.trainer.pipeline.trainer builds a stage per rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


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
