"""Pushing each shard's gradient while backward still runs (`OffloadConfig(push_in_backward=True)`).

A post-accumulate-grad hook on every parameter counts which parameters backward has finished;
when every parameter a shard holds elements of is done, the shard's gradient is final for
this backward, and a GRADIENT_PART push of it starts at once (the daemon holds it, applies
nothing). `step()` then only has to send an APPLY per shard (with the param groups' settings
and the loss scale, known only then), so the transfers overlap the rest of backward instead
of following it.

What makes it exact is knowing when the early copy is no longer the gradient: a second
backward before `step()` (accumulation), a gradient changed after backward
(`clip_grad_norm_`, an unscale, a user's edit), or a shard whose parameters did not all get
a gradient. The gradients are views of one flat buffer and share its version counter, so the
counter's value at the end of backward (an autograd callback) against its value at `step()`
tells whether anything wrote to any gradient since; if so, or for a shard not pushed early,
`step()` sends the whole gradient as a GRADIENT push, which replaces the early part on the
daemon. Training is the same either way; only the overlap is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.io.flat import FlatParams


class BackwardPushes:
    """Hooks that push shards early during backward, and what `step()` may rely on."""

    def __init__(
        self,
        flat: FlatParams,
        shards: list[ShardSlice],
        shards_of: Callable[[int], list[ShardSlice]],
        push_part: Callable[[ShardSlice], Future],
    ) -> None:
        """`shards`: the shards this process pushes; `shards_of(i)`: the shards parameter i
        has elements in; `push_part(shard)`: starts the shard's GRADIENT_PART push."""
        self.flat = flat
        self.push_part = push_part
        mine = {s.shard_id for s in shards}
        self._params_of = {s.shard_id: 0 for s in shards}
        self._shards_of_param: list[list[ShardSlice]] = []
        for index in range(len(flat.params)):
            owned = [s for s in shards_of(index) if s.shard_id in mine]
            self._shards_of_param.append(owned)
            for shard in owned:
                self._params_of[shard.shard_id] += 1
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(flat.params)]
        self._held_elsewhere = False
        self.reset()

    def skipped(self) -> None:
        """The step was skipped (an fp16 overflow): its parts stay held on the daemons for the
        same step number, and the daemons take a resent part 0 of a step as a duplicate of the
        one held (that is what makes a retried push safe). So the next backward's parts do not
        arrive, and that step must be pushed whole, which replaces the held ones."""
        self._held_elsewhere = True

    def reset(self) -> None:
        """A new step: nothing pushed, no backward seen."""
        self._done = [0] * len(self.flat.params)  # backward passes that finished each parameter
        self._waiting = dict(self._params_of)  # per shard: parameters still to finish
        self.parts: dict[int, Future] = {}  # shard id -> its GRADIENT_PART push
        self._version_at_end: int | None = None
        self._moved = False

    def _hook_for(self, index: int):
        def on_grad(param: torch.nn.Parameter) -> None:
            if (param.dtype, param.device) != (self.flat.grads.dtype, self.flat.grads.device):
                self._moved = True  # cast or moved since: step() adopts it (rebind); push it whole
                return
            self.flat.adopt_grad(index)  # a fresh .grad (zero_grad(set_to_none=True)) goes into the buffer
            if not any(self._done):  # the first parameter this backward finished
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._done[index] += 1
            if self._done[index] != 1:
                return  # a second backward before step(): the early parts are stale (see step)
            for shard in self._shards_of_param[index]:
                self._waiting[shard.shard_id] -= 1
                if self._waiting[shard.shard_id] == 0:
                    self.parts[shard.shard_id] = self.push_part(shard)

        return on_grad

    def _end_of_backward(self) -> None:
        self._version_at_end = self.flat.grads._version

    def usable_parts(self) -> dict[int, Future]:
        """At `step()`: the early parts that still are the step's gradient (empty when
        anything wrote to the gradients after backward, or backward ran more than once)."""
        untouched = self._version_at_end is not None and self.flat.grads._version == self._version_at_end
        stale, self._held_elsewhere = self._held_elsewhere, False
        if stale or self._moved or not untouched or max(self._done, default=0) > 1:
            return {}
        return dict(self.parts)

    def rebind(self, flat: FlatParams) -> None:
        """The optimizer adopted the model's new tensors (ps_offload.trainer.offload.
        param_binding): hook those, and count this step's early parts, made from the old
        buffer, as unusable (the step is pushed whole, replacing them). What the daemons hold
        (`skipped`) is kept."""
        self.close()
        self.flat = flat
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(flat.params)]
        self._version_at_end = None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
