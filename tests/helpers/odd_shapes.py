"""A model whose parameters have odd sizes (1, 7, 13, 91, 333, 4329, 2331 elements, Linear(7, 13)
first), so that every shard size cuts some parameter at an offset that is not a multiple of 8:
where torch's fused CPU kernels round a tensor's tail differently from its body. The case, and
the cuts a shard size makes, for the bit-for-bit tests of odd cuts and of the parity audit."""

from __future__ import annotations

import torch
from torch import nn

from ps_offload.proto.plan import layout_params, plan_shards, segments_of

STEPS = 30


class _Scale(nn.Module):
    """A 1-element parameter, which moves every later parameter to an odd flat offset."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def odd_case(steps: int = STEPS):
    torch.manual_seed(0)
    # Flat offsets: fc1.w 0 (91), fc1.b 91 (13), gain 104 (1), fc2.w 105 (4329), fc2.b 4434
    # (333), fc3.w 4767 (2331), fc3.b 7098 (7); 7105 elements.
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), _Scale(), nn.Linear(13, 333), nn.Tanh(), nn.Linear(333, 7))
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(7, 7, generator=g)
    inputs = [torch.randn(16, 7, generator=g) for _ in range(steps)]
    batches = [(x, torch.tanh(x @ teacher)) for x in inputs]

    def loss_fn(m, batch):
        x, y = batch
        return nn.functional.mse_loss(m(x), y)

    return model, batches, loss_fn


def odd_cuts(model: nn.Module, shard_numel: int) -> list[tuple[str, int]]:
    """(parameter, offset) of every shard cut inside a parameter at an offset that is not a
    multiple of 8: the cases the fix is for."""
    layouts = layout_params([(name, tuple(p.shape), None) for name, p in model.named_parameters()])
    total = sum(lo.numel for lo in layouts)
    cuts = []
    for shard in plan_shards(total, shard_numel, 1):
        for seg in segments_of(shard, layouts):
            end = seg.param_start + seg.numel
            if end < seg.param_numel and end % 8:
                cuts.append((layouts[seg.param_index].name, end))
    return cuts
