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

from ps_offload.proto.shared_memory import sealed_memfd
from ps_offload.trainer.wire.slot_region import SlotRegion, WindowPlace

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
        self._maps: dict[int, mmap.mmap] = {}  # by window number: the mappings, kept while the windows are
        self._numbers = 0
        self._regions: list[SlotRegion] = []  # streamed blocks' reserved addresses over slots of a window
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
        if self._attach(fd, mapped, base.data_ptr(), nbytes) is None:
            del base, tensor
            mapped.close()
            os.close(fd)
            return None
        return tensor

    def slot_region(self, nbytes: int, *, slots: int, slot_bytes: int) -> SlotRegion | None:
        """Reserved addresses for `nbytes` of streamed blocks over `slots` reused slots of
        `slot_bytes` in a new window (trainer/wire/slot_region.py); None, nothing kept, where
        addresses cannot be reserved so (not Linux) or no daemon took the window."""
        reserved = SlotRegion.reserve(nbytes)
        if reserved is None:
            return None
        libc, address = reserved
        window_bytes = slots * slot_bytes
        fd = sealed_memfd(window_bytes, "ps-offload-blocks")
        mapped = mmap.mmap(fd, window_bytes)
        base = torch.frombuffer(mapped, dtype=torch.uint8)
        number = self._attach(fd, mapped, base.data_ptr(), window_bytes)
        del base
        if number is None:
            mapped.close()
            os.close(fd)
            libc.munmap(address, nbytes)
            return None
        region = SlotRegion(libc, address, nbytes, number=number, fd=fd, slots=slots, slot_bytes=slot_bytes)
        with self._lock:
            self._regions.append(region)
        return region

    def _attach(self, fd: int, mapped: mmap.mmap, address: int, nbytes: int) -> int | None:
        """Offers the memfd to every node daemon; its window number if one took it."""
        with self._lock:
            self._numbers += 1
            number = self._numbers
            window = HostWindow(number, fd, address, nbytes)
            attachers = list(self._attachers)
        taken = [attach(window) for attach in attachers]
        if not any(taken):
            return None
        with self._lock:
            self._windows.append(window)
            self._maps[number] = mapped
        return number

    def find(self, view: memoryview) -> WindowPlace | None:
        """Where `view` lies in a window (its window, offset and length), or None."""
        nbytes = len(view)
        if not nbytes:
            return None
        start = address_of(view)
        with self._lock:
            regions = list(self._regions)
        for region in regions:  # a block's slot, mapped at the block's address
            if region.address <= start < region.address + region.nbytes:
                return region.ref(start, nbytes)
        for window in self.windows:
            if window.address <= start and start + nbytes <= window.address + window.nbytes:
                return WindowPlace(window.number, start - window.address, nbytes)
        return None
