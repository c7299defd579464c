"""A streamed model's gradients on their way out: each unit's gradient of a backward pass,
gathered from `.grad` into one flat buffer and pushed as soon as the unit's last parameter
has it.

`BlockGradients` is the streamed optimizer's (trainer/stream/optimizer.py) push half. A parameter's
post-accumulate-grad hook hands its gradient over (`add`); a parameter the pass does not
reach counts as zero (its slice is zeroed at the push); the `.grad` is dropped at once, so no
full-model gradient ever exists on the trainer. A complete unit is pushed, one task per shard
in a pool of its own (in a pipeline stage, after `reduce` summed the buffer over the
data-parallel replicas, only this replica's share of the shards): as GRADIENT_PART `part`
(accumulated on the daemons, applied by APPLY), or with `groups` as a GRADIENT (applied on
arrival). Buffers still waiting for their pushes are bounded by `window_bytes`: past it, the
oldest pushes are waited for, so a slow wire paces backward instead of filling memory.
Pushes run on threads of their own, beside the pulls'; the time the caller waits for them is
counted (`wait_seconds`).

For clipping, the first pass of a step also keeps each parameter's 2-norm as torch's
clip_grad_norm_ takes it (`torch._foreach_norm` of the gradient), by parameter index.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.proto.push import Push
from ps_offload.trainer.io.device import ShardMover
from ps_offload.trainer.io.shard_io import ShardIO, blocked_wait
from ps_offload.trainer.stream.units import StreamUnit
from ps_offload.trainer.wire.host_windows import SharedAllocator
from ps_offload.trainer.wire.sharded_client import ShardedClient


class BlockGradients:
    def __init__(
        self,
        units: list[StreamUnit],
        *,
        client: ShardedClient,
        mover: ShardMover,
        io: ShardIO,
        window_bytes: int,
        reduce: Callable[[torch.Tensor], None] | None = None,
        shared: SharedAllocator | None = None,
    ) -> None:
        """`reduce(buffer)`: sums a unit's gradient over data-parallel replicas in place before
        the push (every replica calls it for the same units in the same order); each replica
        then pushes only its shards, `io.pushes`. `shared`: where a CPU gradient buffer may
        live so that the node's daemon reads its pushes in place (ShardedClient.
        shared_host_tensor); such buffers are kept and reused once their pushes are done."""
        self.units = units
        self.reduce = reduce
        self.client = client
        self.mover = mover
        self.io = io
        self.window_bytes = window_bytes
        # Threads of their own: a push holds its thread until the daemon has applied (and, on
        # NVMe, written) the shard, and the next blocks' pulls must not queue behind that.
        self.pool = ThreadPoolExecutor(max_workers=io.workers, thread_name_prefix="ps-push")
        self.norms: dict[int, torch.Tensor] = {}  # parameter index -> its gradient's 2-norm (first pass)
        self._buffers: dict[int, torch.Tensor] = {}  # unit index -> this pass's gradient buffer
        self._received: dict[int, set[int]] = collections.defaultdict(set)  # unit index -> its parameters in
        self._pushed: set[int] = set()  # units whose gradient of this pass is pushed
        # Each unit's pushes, with their buffer (its bytes count against window_bytes).
        self._pushes: collections.deque[tuple[list[Future], torch.Tensor]] = collections.deque()
        self._failures: list[BaseException] = []
        # Seconds the caller's thread waited for pushes: the window full of gradients still on
        # their way (a wire slower than backward), or step() draining the last ones.
        self.wait_seconds = 0.0
        self.shared = shared
        self._spare: dict[int, list[torch.Tensor]] = collections.defaultdict(list)  # by numel: shared, unused
        self._owned: set[int] = set()  # data_ptr of the shared buffers

    def _buffer(self, unit: StreamUnit, device: torch.device) -> torch.Tensor:
        """A buffer for `unit`'s gradient (contents undefined)."""
        if self.shared is not None and device.type == "cpu":
            spare = self._spare[unit.numel]
            if spare:
                return spare.pop()
            buffer = self.shared(unit.numel, unit.values.dtype)
            if buffer is not None:
                self._owned.add(buffer.data_ptr())
                return buffer
        return torch.empty_like(unit.values, device=device)

    def _done(self, pushes: list[Future], buffer: torch.Tensor) -> list[BaseException]:
        """Waits for a unit's pushes; a shared buffer is then free for another."""
        self.wait_seconds += blocked_wait(pushes)
        failures = _failures(pushes)
        if buffer.data_ptr() in self._owned:
            self._spare[buffer.numel()].append(buffer)
        return failures

    def add(self, unit: StreamUnit, i: int, grad: torch.Tensor, *, norm_index: int | None) -> bool:
        """Copies parameter i of `unit`'s gradient into the unit's buffer (and keeps its norm
        under `norm_index`); returns whether the unit is complete."""
        buffer = self._buffers.get(unit.index)
        if buffer is None:  # not zeroed: every parameter's slice is written, or zeroed at push()
            buffer = self._buffers[unit.index] = self._buffer(unit, grad.device)
        offset = unit.offsets[i]
        buffer[offset : offset + grad.numel()].view(grad.shape).copy_(grad)
        if norm_index is not None:
            self.norms[norm_index] = torch._foreach_norm([grad], 2.0)[0]
        self._received[unit.index].add(i)
        return len(self._received[unit.index]) == len(unit.params)

    def push(self, unit: StreamUnit, *, step: int, part: int, groups: list[ps_pb2.GroupHyperparams] | None) -> None:
        """Pushes the unit's buffer of this pass (zeros if nothing came) and forgets it."""
        buffer = self._buffers.pop(unit.index, None)
        received = self._received.pop(unit.index, set())
        if buffer is None:
            buffer = self._buffer(unit, unit.values.device).zero_()
        elif len(received) < len(unit.params):  # parameters the pass did not reach count as zero
            for i, p in enumerate(unit.params):
                if i not in received:
                    buffer[unit.offsets[i] : unit.offsets[i] + p.numel()].zero_()
        if self.reduce is not None:
            self.reduce(buffer)
        after = self.mover.mark_compute()
        mine = [s for s in unit.shards if s.shard_id in self.io.pushes]
        datas = [self.mover.in_place(buffer, unit.local(s)) for s in mine]
        if any(data is None for data in datas):  # staged: a task (and a host buffer) per shard
            pushes = [self.pool.submit(self._push, unit, s, step, part, groups, buffer, after) for s in mine]
        else:  # in place: a daemon's shards in one batch
            pushes = [
                self.pool.submit(self._push_batch, [mine[i] for i in g], [datas[i] for i in g], step, part, groups)
                for g in self.client.batches(mine)
            ]
        self._pushed.add(unit.index)
        self._pushes.append((pushes, buffer))
        while len(self._pushes) > 1 and sum(b.numel() * b.element_size() for _, b in self._pushes) > self.window_bytes:
            self._failures.extend(self._done(*self._pushes.popleft()))

    def _push(
        self, unit: StreamUnit, shard: ShardSlice, step: int, part: int, groups: list | None, buffer, after: object
    ) -> ps_pb2.PushResponse:
        with self.mover.host_view(buffer, unit.local(shard), after) as data:
            push = self._gradient(shard, data, step, part, groups)
            return self.io.counted(self.client.push(shard, push), len(data))

    def _push_batch(
        self, shards: list[ShardSlice], datas: list[memoryview], step: int, part: int, groups: list | None
    ) -> None:
        pushes = [self._gradient(shard, data, step, part, groups) for shard, data in zip(shards, datas, strict=True)]
        acks = self.client.push_batch(shards, pushes)
        for data, ack in zip(datas, acks, strict=True):
            if not isinstance(ack, BaseException):
                self.io.counted(ack, len(data))
        failure = next((ack for ack in acks if isinstance(ack, BaseException)), None)
        if failure is not None:
            raise failure

    def _gradient(self, shard: ShardSlice, data: memoryview, step: int, part: int, groups: list | None) -> Push:
        model, encoding = self.client.model, self.mover.gradient_encoding
        if groups is not None:  # applied on arrival, with these settings
            return Push.gradient(model, shard.shard_id, data, step=step, encoding=encoding, groups=groups)
        return Push.gradient_part(model, shard.shard_id, data, step=step, part=part, encoding=encoding)

    def unpushed(self) -> list[StreamUnit]:
        """The units whose gradient of this pass has not been pushed (the pass ends)."""
        return [unit for unit in self.units if unit.index not in self._pushed]

    def end_pass(self) -> None:
        self._pushed.clear()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def drain(self) -> list[BaseException]:
        """Waits for every push; returns the failures since the last drain."""
        failures, self._failures = self._failures, []
        while self._pushes:
            failures.extend(self._done(*self._pushes.popleft()))
        return failures


def _failures(pushes: list[Future]) -> list[BaseException]:
    wait(pushes)
    return [f.exception() for f in pushes if f.exception() is not None]
