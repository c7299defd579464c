"""Flat buffers: a list of parameters whose `.data` and `.grad` are views into two flat tensors.

    flat = FlatParams(model.named_parameters())
    flat.values   # every parameter, in order, at the offsets of the shard plan's layout
    flat.grads    # every .grad, the same way: one slice of it is one shard's or one bucket's

The layout is ps_proto/plan.py's `layout_params`, the one the daemons lay their shards out
by, so a shard or an all-reduce bucket is one contiguous range of each buffer and nothing is
copied parameter by parameter. Autograd writes into `.grad` in place; when someone replaces
a `.grad` (model.zero_grad(set_to_none=True), then backward), `adopt_grad` copies it back
into the buffer and re-points it. Both the daemon-backed optimizer and the in-process one
(and the data-parallel reducer that works on their gradients) go through this class.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ps_offload.proto.plan import ParamLayout, layout_params
from ps_offload.trainer.wire.host_windows import SharedAllocator


class FlatParams:
    """`params` re-pointed into `values` and `grads`.

    Invariants: `params[i].data` is `values[layouts[i].offset : + numel]` viewed as its shape,
    and so is `params[i].grad` in `grads` (after `adopt_grads()`); elements of the buffers
    that no parameter covers (padding a layout may place) stay zero."""

    def __init__(
        self, named_params: Iterable[tuple[str, nn.Parameter]], *, shared: SharedAllocator | None = None
    ) -> None:
        """`shared`: for a model on the CPU, where the buffers may live so that the node's
        daemon reads and writes them in place (ShardedClient.shared_host_tensor)."""
        named = list(named_params)
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.layouts: list[ParamLayout] = layout_params([(name, tuple(p.shape), None) for name, p in named])
        self.numel = max(layout.offset + layout.numel for layout in self.layouts)
        first = self.params[0]
        self.values, self.grads = (self.buffer_like(first, shared, self.numel) for _ in range(2))
        with torch.no_grad():
            for index, p in enumerate(self.params):
                value = self._view(self.values, index)
                value.copy_(p)
                p.data = value
                self.adopt_grad(index)

    @staticmethod
    def buffer_like(like: torch.Tensor, shared: SharedAllocator | None, numel: int | None = None) -> torch.Tensor:
        """A zeroed flat buffer of `numel` (default: like's) elements, `like`'s dtype and
        device; on the CPU from `shared` when it gives one."""
        numel = like.numel() if numel is None else numel
        if shared is not None and like.device.type == "cpu":
            buffer = shared(numel, like.dtype)
            if buffer is not None:
                return buffer  # zeroed: a new memfd
        return torch.zeros(numel, dtype=like.dtype, device=like.device)

    def _view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        layout = self.layouts[index]
        return buffer[layout.offset : layout.offset + layout.numel].view(layout.shape)

    def value_view(self, index: int) -> torch.Tensor:
        """Parameter `index`'s slice of `values`, shaped as the parameter (what its `.data`
        is, unless something re-pointed it)."""
        return self._view(self.values, index)

    def grad_view(self, index: int) -> torch.Tensor:
        """Parameter `index`'s slice of `grads`, shaped as the parameter."""
        return self._view(self.grads, index)

    def adopt_grad(self, index: int) -> None:
        """Points parameter `index`'s `.grad` back into `grads`: a gradient that autograd or
        the caller put elsewhere is copied in, a missing one counts as zero."""
        p, view = self.params[index], self.grad_view(index)
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        else:
            return
        p.grad = view

    def adopt_grads(self) -> None:
        for index in range(len(self.params)):
            self.adopt_grad(index)

    def zero_grads(self, set_to_none: bool = False) -> None:
        """The optimizers' zero_grad, as torch.optim's: every `.grad` None (backward then makes
        new ones, which adopt_grads copies into the buffer), or re-pointed into the buffer and
        zeroed (no copy at the next step)."""
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        self.adopt_grads()
        self.grads.zero_()

    def param_range(self, index: int) -> tuple[int, int]:
        """[start, end) of parameter `index` in the buffers."""
        layout = self.layouts[index]
        return layout.offset, layout.offset + layout.numel
