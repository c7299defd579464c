"""The model of three param groups whose settings change every step: odd shapes (91, 13, 1,
4329, 333, 2331, 7 elements: 7105) that interleave in the flat layout, so that shard cuts land
inside parameters; each group's torch.optim settings for a step (decaying lr, growing weight
decay, moving betas, momentum and dampening) as the daemon's GroupSettings and as the wire's
GroupHyperparams; its initial values and gradients; its spec; and its torch twin, fused
AdamW or SGD holding the same groups."""

from __future__ import annotations

import math

import torch

from ps_offload.optimizers import GroupSettings
from ps_offload.proto import ps_pb2

SHAPES = ((13, 7), (13,), (1,), (333, 13), (333,), (7, 333), (7,))
GROUP_OF = (0, 1, 2, 0, 1, 0, 2)
NUMEL = 7105


def settings(kind: str, step: int, group: int) -> dict:
    """Group `group`'s torch.optim settings for `step`: each changes from step to step and
    differs between groups (decaying lr, growing weight decay, moving betas and momentum)."""
    decay = (0.1, 0.0, 0.02, 0.3)[group] * (1 + step / 4)
    if kind == "adamw":
        betas = (0.9 - 0.05 * group + 0.01 * step, 0.999 - 0.004 * group - 0.001 * step)
        return dict(
            lr=3e-3 * (1 + group) * 0.8**step, weight_decay=decay, betas=betas, eps=1e-8 * 10**group * (1 + step)
        )
    return dict(
        lr=0.05 * (1 + group) * 0.9**step,
        weight_decay=decay / 100,
        momentum=0.9 - 0.1 * group - 0.02 * step,
        dampening=0.05 * group + 0.02 * step,
    )


def daemon_groups(kind: str, step: int, count: int = 3) -> tuple[GroupSettings, ...]:
    return tuple(GroupSettings(**_fields(settings(kind, step, g))) for g in range(count))


def proto_groups(kind: str, step: int, count: int = 3) -> list[ps_pb2.GroupHyperparams]:
    return [ps_pb2.GroupHyperparams(**_fields(settings(kind, step, g))) for g in range(count)]


def _fields(torch_settings: dict) -> dict:
    fields = dict(torch_settings)
    if "betas" in fields:
        fields["beta1"], fields["beta2"] = fields.pop("betas")
    return fields


def initial_values(shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in shapes]


def gradients(step: int, shapes=SHAPES) -> list[torch.Tensor]:
    """Gradients over several orders of magnitude (so that the kernels' two loops' roundings
    show), below 0.4 so that times 2**16 they still fit fp16."""
    g = torch.Generator().manual_seed(100 + step)
    return [
        (torch.rand(shape, generator=g) - 0.5) * 0.8 * 10.0 ** torch.randint(-4, 1, shape, generator=g).float()
        for shape in shapes
    ]


class TorchReference:
    """torch.optim.AdamW / SGD (fused=True) on fp32 copies, one param group per group index."""

    def __init__(self, kind: str, initial: list[torch.Tensor], group_of=GROUP_OF, dtype=torch.float32) -> None:
        self.kind, self.group_of = kind, group_of
        self.params = [t.to(dtype, copy=True).requires_grad_() for t in initial]
        count = max(group_of) + 1
        groups = [
            {
                "params": [p for p, g in zip(self.params, group_of, strict=True) if g == group],
                **settings(kind, 0, group),
            }
            for group in range(count)
        ]
        self.optimizer = (
            torch.optim.AdamW(groups, fused=True) if kind == "adamw" else torch.optim.SGD(groups, fused=True)
        )

    def step(self, step: int, grads: list[torch.Tensor]) -> None:
        for index, group in enumerate(self.optimizer.param_groups):
            group.update(settings(self.kind, step, index))  # as a scheduler does between steps
        for p, grad in zip(self.params, grads, strict=True):
            p.grad = grad.to(p.dtype, copy=True)
        self.optimizer.step()

    def flat(self, state: str = "") -> torch.Tensor:
        """The parameters (or a state tensor, "exp_avg"...) flattened in layout order."""
        tensors = [self.optimizer.state[p][state] if state else p for p in self.params]
        return torch.cat([t.detach().reshape(-1) for t in tensors])


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor) -> list[torch.Tensor]:
    """A flat tensor of NUMEL cut back into SHAPES."""
    sizes = [math.prod(shape) for shape in SHAPES]
    return [piece.reshape(shape) for piece, shape in zip(flat.split(sizes), SHAPES, strict=True)]


def group_model_spec(name: str, kind: str, *, shard_bytes: int, groups=GROUP_OF) -> ps_pb2.ModelSpec:
    """Registered with settings that no push of these tests uses: every push carries its groups'."""
    if kind == "adamw":
        optimizer = ps_pb2.OptimizerSpec(
            adamw=ps_pb2.AdamWSpec(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.5)
        )
    else:
        optimizer = ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=0.5, momentum=0.5))
    params = [
        ps_pb2.ParamSpec(name=f"p{i}", shape=list(shape), dtype=ps_pb2.FLOAT32, group=group)
        for i, (shape, group) in enumerate(zip(SHAPES, groups, strict=True))
    ]
    return ps_pb2.ModelSpec(model=name, params=params, optimizer=optimizer, shard_bytes=shard_bytes, daemons=["d0"])
