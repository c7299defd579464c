"""A stage's gradient all-reduce over its dp replicas, in buckets started during backward."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ps_offload.trainer.config import ParallelConfig
from ps_offload.trainer.io.flat import FlatParams

BUCKET_BYTES = ParallelConfig.bucket_bytes
FIRST_BUCKET_BYTES = ParallelConfig.first_bucket_bytes


class GradReducer:
    """Sums a stage's gradients over its dp group in buckets that start during backward.

    A bucket is a contiguous range of `flat.grads`. Buckets are formed from the end
    (backward produces the last layers' gradients first), the first one small so the
    network starts early. `hook(bucket, group)` replaces the plain all-reduce (the place
    compression plugs in); it must leave the sum in `bucket` and may return a work handle
    to wait on."""

    def __init__(
        self,
        flat: FlatParams,
        group: dist.ProcessGroup,
        *,
        microbatches: int,
        bucket_bytes: int = BUCKET_BYTES,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        hook: Callable[[torch.Tensor, dist.ProcessGroup], object] | None = None,
    ) -> None:
        self.flat = flat
        self.flat_grads = flat.grads
        self.group = group
        self.world = dist.get_world_size(group)
        self.microbatches = microbatches
        self.hook = hook
        params = flat.params
        self.buckets: list[tuple[int, int, list[int]]] = []  # (lo, hi, param indices)
        limit, members, hi = first_bucket_bytes, [], flat.numel
        for index in range(len(params) - 1, -1, -1):
            members.append(index)
            lo = flat.param_range(index)[0]
            if (hi - lo) * flat.grads.element_size() >= limit or index == 0:
                self.buckets.append((lo, hi, members))
                limit, members, hi = bucket_bytes, [], lo
        self._bucket_of = {i: b for b, (_, _, members) in enumerate(self.buckets) for i in members}
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(params)]
        self.start_step()

    def start_step(self) -> None:
        self._counts = [0] * len(self.flat.params)
        self._ready = [0] * len(self.buckets)
        self._works: dict[int, object] = {}

    def _hook_for(self, index: int):
        def on_grad(param: nn.Parameter) -> None:
            self.flat.adopt_grad(index)  # autograd may have made a new tensor (zero_grad(set_to_none=True))
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
