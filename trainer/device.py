"""Shards between the trainer's device and the wire, whatever the device and the compute dtype.

    mover = ShardMover(flat.values, max_shard_numel, config=DeviceConfig())
    with mover.host_view(flat.grads, shard, after) as data: push(data)
    mover.pull(flat.values, shard, after, lambda into: pull_into(into))

The daemons keep fp32; the trainer keeps only its compute copy, in the model's dtype, on its
device. What travels is that dtype (proto PullRequest.dtype, the BF16 and FP16 push
encodings), so a bf16 model moves half the bytes of an fp32 one and the daemon does the
widening (exact) and the rounding (as `Tensor.to(dtype)` does).

Two ways to get a shard's bytes to and from the wire:

* In place (a CPU model, the default there): the push reads the gradient buffer's own bytes
  and the pull writes into the parameter buffer's. Nothing is copied.
* Staged (an accelerator, or `DeviceConfig(staging="always")` to run the same path on the
  CPU): a bounded pool of host buffers of one shard each, pinned where the device can pin.
  A push copies the shard's gradients into one, a pull lands in one and is copied up. The
  accelerator's side (side stream, events, pinned allocation) is in trainer/accelerator.py;
  on the CPU the same steps are plain copies.

`after` is what the copies must follow on the device: the compute stream's work up to
`step()` (backward writes the gradients; forward and backward still read the parameters
when kernels run behind the host). Every copy is complete when its call returns, so the
pull's future completing is what a module's forward waits for.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import resource
from collections.abc import Callable, Iterator

import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.config import DeviceConfig

WIRE_DTYPES = {torch.float32: ps_pb2.FLOAT32, torch.bfloat16: ps_pb2.BFLOAT16, torch.float16: ps_pb2.FLOAT16}
"""What a compute dtype travels as in pulls (PullRequest.dtype)."""
GRADIENT_ENCODINGS = {torch.float32: ps_pb2.RAW, torch.bfloat16: ps_pb2.BF16, torch.float16: ps_pb2.FP16}
"""How its gradients travel in pushes: as they are; the daemon widens them to fp32 exactly."""


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor of any dtype (numpy has no bfloat16)."""
    return memoryview(tensor.view(torch.uint8).numpy())


def resizable_byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without numpy: a tensor shared with numpy has
    its storage marked not resizable, and a streamed block's storage is freed and given back
    (trainer/stream_units.py). The view does not keep the tensor alive: the caller does."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class MemlockError(RuntimeError):
    """The pinned host buffers would exceed RLIMIT_MEMLOCK."""


def check_memlock(nbytes: int) -> None:
    """Pinned buffers are locked memory: refuse at start, with what to change, rather than fail
    (or thrash the host) mid-run when they outgrow the limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and nbytes > soft:
        raise MemlockError(
            f"the pinned host buffers need {nbytes} bytes of locked memory, RLIMIT_MEMLOCK allows {soft}: "
            "raise it (`ulimit -l unlimited`, LimitMEMLOCK=infinity in a systemd unit, `--ulimit memlock=-1` "
            "for docker) or lower DeviceConfig.host_buffers or OffloadConfig.shard_bytes"
        )


class HostBuffers:
    """`count` host buffers of `numel` elements of `dtype`, handed out one per transfer; a
    transfer waits for one to come back when all are out. Pinned when `pin`."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, *, pin: bool) -> None:
        self.count = count
        self.nbytes = count * numel * dtype.itemsize
        if pin:
            check_memlock(self.nbytes)
        self.pinned = pin
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(torch.empty(numel, dtype=dtype, pin_memory=pin))

    @contextlib.contextmanager
    def buffer(self, numel: int) -> Iterator[torch.Tensor]:
        taken = self._free.get()
        try:
            yield taken[:numel]
        finally:
            self._free.put(taken)


class HostCopies:
    """The CPU's side of a staged transfer: plain copies, nothing to order against."""

    def mark_compute(self, device: torch.device) -> None:
        return None

    def to_host(self, source: torch.Tensor, host: torch.Tensor, after: object) -> None:
        host.copy_(source)

    def to_device(self, host: torch.Tensor, target: torch.Tensor, after: object) -> None:
        target.copy_(host)


class ShardMover:
    """Moves shard slices of flat device buffers (trainer/flat.py) to and from the wire."""

    def __init__(
        self, like: torch.Tensor, max_shard_numel: int, *, config: DeviceConfig, resizable: bool = False
    ) -> None:
        """`like`: a flat buffer (device and dtype of the compute copy); `max_shard_numel`:
        the largest shard of the plan; `resizable`: the buffers pulled into in place must
        stay resizable (a streamed model's)."""
        self._in_place_view = resizable_byte_view if resizable else byte_view
        if like.dtype not in WIRE_DTYPES:
            raise ValueError(f"parameters in {like.dtype} cannot be offloaded: use float32, bfloat16 or float16")
        self.device = like.device
        self.dtype = like.dtype
        self.wire_dtype = WIRE_DTYPES[like.dtype]
        self.gradient_encoding = GRADIENT_ENCODINGS[like.dtype]
        on_cpu = like.device.type == "cpu"
        self.staged = config.staging == "always" or not on_cpu
        self.buffers: HostBuffers | None = None
        if self.staged:
            if on_cpu:
                self.copies = HostCopies()
            else:
                from ps_offload.trainer.accelerator import AcceleratorCopies

                self.copies = AcceleratorCopies(like.device)
            self.buffers = HostBuffers(config.host_buffers, max_shard_numel, like.dtype, pin=not on_cpu)

    @property
    def host_bytes(self) -> int:
        """Bytes of host buffers held (pinned ones when the device is an accelerator)."""
        return self.buffers.nbytes if self.buffers is not None else 0

    def mark_compute(self) -> object:
        """What a step's copies must follow: the device's work queued so far (None on the CPU)."""
        return self.copies.mark_compute(self.device) if self.staged else None

    @contextlib.contextmanager
    def host_view(self, buffer: torch.Tensor, shard: ShardSlice, after: object) -> Iterator[memoryview]:
        """The bytes of `buffer`'s slice for `shard`, on the host, for as long as the block
        runs (a push reads them there)."""
        piece = buffer[shard.offset : shard.end]
        if not self.staged:
            yield byte_view(piece)
            return
        with self.buffers.buffer(shard.numel) as host:
            self.copies.to_host(piece, host, after)
            yield byte_view(host)

    def pull(self, buffer: torch.Tensor, shard: ShardSlice, after: object, fill: Callable[[memoryview], int]) -> int:
        """Lets `fill` write the shard's bytes (in the compute dtype) and puts them into
        `buffer`'s slice; returns what `fill` returned (the version pulled)."""
        piece = buffer[shard.offset : shard.end]
        if not self.staged:
            return fill(self._in_place_view(piece))
        with self.buffers.buffer(shard.numel) as host:
            version = fill(byte_view(host))
            self.copies.to_device(host, piece, after)
        return version
