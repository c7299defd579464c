"""Host memory this process shares with its node's daemons: windows.

A window is a memfd (ps_offload.proto.shared_memory) mapped here and, once attached, by the
node's daemon (ps_offload.daemon.dataplane.local_pool). The trainer keeps its buffers in
them where it can (a CPU model's flat parameters and gradients, a GPU model's staging
buffers): a pull into a window is written there by the daemon, rounded to the compute dtype
on the way, and a push from one is read by the daemon where it lies, so on the node's own
daemon neither costs the trainer a copy (ps_offload.trainer.wire.local_client).

Windows count against the node's pool (the daemon's server.local_pool_bytes). A daemon that
refuses one (its pool is full) leaves the buffer here, ordinary memory: the bytes then go
through the connection's slot, one more copy.

A window's memory lives as long as its tensors here; the daemon's mapping until the
connections of this process to it have closed.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ps_offload.proto import ps_pb2
from ps_offload.proto.shared_memory import sealed_memfd

Prepare = Callable[[torch.Tensor], bool]
"""Readies a window's tensor before it is offered to the daemons; False: do not use it."""
SharedAllocator = Callable[..., torch.Tensor | None]
"""(numel, dtype, prepare=None) -> a tensor in a window, or None: ShardedClient.shared_host_tensor."""


@dataclass(frozen=True)
class HostWindow:
    number: int  # LocalRef.window; 0 is a connection's slot
    fd: int  # kept open: a connection made later (a restarted daemon) attaches it too
    address: int
    nbytes: int


def address_of(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


class HostWindows:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: list[HostWindow] = []
        self._maps: dict[int, mmap.mmap] = {}  # by window number: free_pages works on them
        self._numbers = 0
        # Each daemon's local client: attach(window) -> whether that daemon took it.
        self._attachers: list[Callable[[HostWindow], bool]] = []

    @property
    def windows(self) -> list[HostWindow]:
        with self._lock:
            return list(self._windows)

    def add_attacher(self, attach: Callable[[HostWindow], bool]) -> None:
        with self._lock:
            self._attachers.append(attach)

    def remove_attacher(self, attach: Callable[[HostWindow], bool]) -> None:
        with self._lock:
            if attach in self._attachers:
                self._attachers.remove(attach)

    def allocate(self, numel: int, dtype: torch.dtype, prepare: Prepare | None = None) -> torch.Tensor | None:
        """A zeroed tensor of `numel` elements of `dtype` in a new window, attached to every
        node daemon this process uses; None (nothing kept) when none of them took it, or
        when `prepare(tensor)` (CUDA's page-locking) said False before it was offered."""
        nbytes = max(numel * dtype.itemsize, 1)
        fd = sealed_memfd(nbytes, "ps-offload-window")
        mapped = mmap.mmap(fd, nbytes)
        base = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the mapping alive with its views
        tensor = base[: numel * dtype.itemsize].view(dtype)
        if prepare is not None and not prepare(tensor):
            del base, tensor
            mapped.close()
            os.close(fd)
            return None
        with self._lock:
            self._numbers += 1
            number = self._numbers
            window = HostWindow(number, fd, base.data_ptr(), nbytes)
            attachers = list(self._attachers)
        taken = [attach(window) for attach in attachers]
        if not any(taken):
            del base, tensor
            mapped.close()
            os.close(fd)
            return None
        with self._lock:
            self._windows.append(window)
            self._maps[number] = mapped
        return tensor

    def free_pages(self, tensor: torch.Tensor) -> bool:
        """Gives the whole pages of `tensor` (in a window) back to the kernel, for this process
        and the daemons alike (MADV_REMOVE on the shared memory: it reads as zeros after, and
        takes memory again when written). Whether it lay in a window."""
        nbytes = tensor.numel() * tensor.element_size()
        start = tensor.data_ptr()
        for window in self.windows:
            if window.address <= start and start + nbytes <= window.address + window.nbytes:
                first = -(-(start - window.address) // mmap.PAGESIZE) * mmap.PAGESIZE
                last = (start - window.address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
                if last > first:
                    self._maps[window.number].madvise(mmap.MADV_REMOVE, first, last - first)
                return True
        return False

    def find(self, view: memoryview) -> ps_pb2.LocalRef | None:
        """Where `view` lies in a window (its window, offset and length), or None."""
        nbytes = len(view)
        if not nbytes:
            return None
        start = address_of(view)
        for window in self.windows:
            if window.address <= start and start + nbytes <= window.address + window.nbytes:
                return ps_pb2.LocalRef(window=window.number, offset=start - window.address, nbytes=nbytes)
        return None
