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
  accelerator's side (side streams, events, pinned allocation) is in trainer/io/accelerator.py;
  on the CPU the same steps are plain copies. The buffers' bytes are bounded at start by
  `DeviceConfig.max_pinned_bytes` and by the host's available memory (`check_host_buffers`).

`after` is what the copies must follow on the device: the compute stream's work up to
`step()` (backward writes the gradients; forward and backward still read the parameters
when kernels run behind the host). It is taken with `mark_compute()` on the training thread,
whose current stream is the compute stream, and handed to the I/O threads, whose current
stream is not (a thread starts on the default stream): every copy, and every compression
(`following(after)`), waits for it. Every copy is complete when its call returns, so the
pull's future completing is what a module's forward waits for.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import resource
import weakref
from collections.abc import Callable, Iterator

import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.memory import mem_available
from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.config import DeviceConfig
from ps_offload.trainer.wire.host_windows import SharedAllocator

log = logging.getLogger(__name__)

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
    (trainer/stream/units.py). The view does not keep the tensor alive: the caller does."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


PINNED_SHARE = 4
"""Without DeviceConfig.max_pinned_bytes, the host buffers may take 1/PINNED_SHARE of the
host's MemAvailable: pinned pages cannot be paged out, and the node's daemon keeps its RAM
tier in the same memory."""
_FEWER = "or lower DeviceConfig.host_buffers or OffloadConfig.shard_bytes"


class PinnedMemoryError(RuntimeError):
    """The host buffers would take more memory than DeviceConfig.max_pinned_bytes allows or
    than the host has available."""


def check_host_buffers(nbytes: int, *, budget: int | None, available: int | None) -> int | None:
    """Refuses host buffers of `nbytes` that would not fit, saying what to change: more than
    `budget` (DeviceConfig.max_pinned_bytes; None: `available` // PINNED_SHARE), or more than
    `available` (the host's MemAvailable; None where unknown, and then only a given budget
    binds). Returns the bound that applied (None: none). Pure: a test drives it with any
    numbers. RLIMIT_MEMLOCK is not a bound: CUDA's pinned allocations (cudaHostAlloc) are not
    charged to it (see `note_memlock`)."""
    if available is not None and nbytes > available:
        raise PinnedMemoryError(
            f"the host buffers need {nbytes} bytes, the host has {available} available (MemAvailable): "
            f"free memory on the host, {_FEWER}"
        )
    if budget is not None:
        if nbytes > budget:
            raise PinnedMemoryError(
                f"the host buffers need {nbytes} bytes, DeviceConfig.max_pinned_bytes allows {budget}: "
                f"raise DeviceConfig.max_pinned_bytes, {_FEWER}"
            )
        return budget
    if available is None:
        return None
    default = available // PINNED_SHARE
    if nbytes > default:
        raise PinnedMemoryError(
            f"the host buffers need {nbytes} bytes, more than 1/{PINNED_SHARE} of the host's available memory "
            f"({default} of {available} bytes MemAvailable), the default bound: set DeviceConfig.max_pinned_bytes "
            f"(at most MemAvailable), {_FEWER}"
        )
    return default


def note_memlock(nbytes: int) -> None:
    """RLIMIT_MEMLOCK, for the record only: CUDA pins with cudaHostAlloc, which the kernel does
    not charge to it (mlock would be), so a limit below the buffers is no reason to refuse."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and nbytes > soft:
        log.debug("pinned host buffers of %d bytes exceed RLIMIT_MEMLOCK (%d): not charged to it by CUDA", nbytes, soft)


class HostBuffers:
    """`count` host buffers of `numel` elements of `dtype`, handed out one per transfer; a
    transfer waits for one to come back when all are out. Pinned when `pin`. Refused at start
    (PinnedMemoryError) when they would not fit `max_bytes` or the host (check_host_buffers)."""

    def __init__(
        self,
        count: int,
        numel: int,
        dtype: torch.dtype,
        *,
        pin: bool,
        max_bytes: int | None = None,
        shared: SharedAllocator | None = None,
    ) -> None:
        """`shared`: where the node's daemon can reach them (ShardedClient.shared_host_tensor),
        page-locked there with CUDA when `pin`; elsewhere, or where that is refused, they are
        the process's own (pin_memory when `pin`)."""
        self.count = count
        self.nbytes = count * numel * dtype.itemsize
        bound = check_host_buffers(self.nbytes, budget=max_bytes, available=mem_available())
        block = None
        if shared is not None:
            block = shared(count * numel, dtype, prepare=_register_host if pin else None)
        self.shared = block is not None  # one window of the node's pool, shared with its daemon
        if block is not None and pin:  # registered with CUDA: unregistered when these buffers go
            weakref.finalize(self, _unregister_host, block.data_ptr())
        log.info(
            "%s%s host buffers: %d of %d bytes, %d bytes in all (bound %s)",
            "pinned" if pin else "unpinned", ", shared with the node's daemon," if self.shared else "",
            count, numel * dtype.itemsize, self.nbytes, bound,
        )  # fmt: skip
        if pin:
            note_memlock(self.nbytes)
        self.pinned = pin
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for index in range(count):
            if block is not None:
                self._free.put(block[index * numel : (index + 1) * numel])
            else:
                self._free.put(torch.empty(numel, dtype=dtype, pin_memory=pin))

    @contextlib.contextmanager
    def buffer(self, numel: int) -> Iterator[torch.Tensor]:
        taken = self._free.get()
        try:
            yield taken[:numel]
        finally:
            self._free.put(taken)

    @contextlib.contextmanager
    def spare(self, numel: int) -> Iterator[torch.Tensor | None]:
        """A buffer if one is free now, else None: never waits (a transfer holding one buffer
        may ask for a second without a deadlock)."""
        try:
            taken = self._free.get_nowait()
        except queue.Empty:
            yield None
            return
        try:
            yield taken[:numel]
        finally:
            self._free.put(taken)


def _register_host(host: torch.Tensor) -> bool:
    from ps_offload.trainer.io.accelerator import register_host  # only a GPU runs it

    return register_host(host)


def _unregister_host(address: int) -> None:
    from ps_offload.trainer.io.accelerator import unregister_host

    unregister_host(address)


class HostCopies:
    """The CPU's side of a staged transfer: plain copies, nothing to order against."""

    def mark_compute(self, device: torch.device) -> None:
        return None

    def following(self, after: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def to_host(self, source: torch.Tensor, host: torch.Tensor, after: object) -> None:
        host.copy_(source)

    def to_device(self, host: torch.Tensor, target: torch.Tensor, after: object) -> None:
        target.copy_(host)


class PullTarget:
    """A push's PullInto place (`view`), and, staged, the host buffer behind it and the device
    slice it goes up to once the push says it was written (`land`)."""

    def __init__(
        self, view: memoryview, host: torch.Tensor | None, piece: torch.Tensor | None, mover: ShardMover | None
    ) -> None:
        self.view, self._host, self._piece, self._mover = view, host, piece, mover

    def land(self, after: object) -> None:
        if self._host is not None:
            self._mover.copies.to_device(self._host, self._piece, after)


class ShardMover:
    """Moves shard slices of flat device buffers (trainer/io/flat.py) to and from the wire."""

    def __init__(
        self,
        like: torch.Tensor,
        max_shard_numel: int,
        *,
        config: DeviceConfig,
        resizable: bool = False,
        shared: SharedAllocator | None = None,
    ) -> None:
        """`like`: a flat buffer (device and dtype of the compute copy); `max_shard_numel`:
        the largest shard of the plan; `resizable`: the buffers pulled into in place must
        stay resizable (a streamed model's); `shared`: where the host buffers may live
        (HostBuffers')."""
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
                from ps_offload.trainer.io.accelerator import AcceleratorCopies

                self.copies = AcceleratorCopies(like.device)
            self.buffers = HostBuffers(
                config.host_buffers,
                max_shard_numel,
                like.dtype,
                pin=not on_cpu,
                max_bytes=config.max_pinned_bytes,
                shared=shared,
            )

    @property
    def host_bytes(self) -> int:
        """Bytes of host buffers held (pinned ones when the device is an accelerator)."""
        return self.buffers.nbytes if self.buffers is not None else 0

    def mark_compute(self) -> object:
        """What a step's copies must follow: the device's work queued so far on the calling
        thread's current stream (None on the CPU). Take it on the training thread."""
        return self.copies.mark_compute(self.device) if self.staged else None

    def following(self, after: object) -> contextlib.AbstractContextManager[None]:
        """A block whose device work (a push's compression kernels, run on an I/O thread) runs
        after `after` and is complete when the block ends. Nothing to do on the CPU."""
        return self.copies.following(after) if self.staged else contextlib.nullcontext()

    @contextlib.contextmanager
    def host_copy(self, buffer: torch.Tensor, shard: ShardSlice, after: object) -> Iterator[torch.Tensor]:
        """`buffer`'s slice for `shard` as a CPU tensor in the compute dtype, for as long as
        the block runs: the slice itself in place, or a host buffer it was copied into after
        `after`."""
        piece = buffer[shard.offset : shard.end]
        if not self.staged:
            yield piece
            return
        with self.buffers.buffer(shard.numel) as host:
            self.copies.to_host(piece, host, after)
            yield host

    @contextlib.contextmanager
    def host_view(self, buffer: torch.Tensor, shard: ShardSlice, after: object) -> Iterator[memoryview]:
        """The bytes of `buffer`'s slice for `shard`, on the host, for as long as the block
        runs (a push reads them there)."""
        with self.host_copy(buffer, shard, after) as host:
            yield byte_view(host)

    @contextlib.contextmanager
    def pull_target(self, buffer: torch.Tensor, shard: ShardSlice) -> Iterator[PullTarget | None]:
        """Where a push may have its new version written in the compute dtype (PullInto), for
        as long as the block runs: `buffer`'s slice itself in place, or, staged, a spare host
        buffer if one is free now (never waited for: None then, and the step pulls)."""
        if not self.staged:
            yield PullTarget(self._in_place_view(buffer[shard.offset : shard.end]), None, None, None)
            return
        with self.buffers.spare(shard.numel) as host:
            yield None if host is None else PullTarget(byte_view(host), host, buffer[shard.offset : shard.end], self)

    def in_place(self, buffer: torch.Tensor, shard: ShardSlice) -> memoryview | None:
        """The bytes of `buffer`'s slice for `shard`, where pulls write and pushes read them in
        place (a CPU buffer, not staged); None when staged."""
        return None if self.staged else self._in_place_view(buffer[shard.offset : shard.end])

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
