"""Streamed blocks at fixed addresses over a few reused slots of a window shared with the daemon.

A streamed model's blocks come and go while their parameters stay the same tensors (autograd
keeps them between a block's forward and its backward), so each block needs the same address
every time it is fetched. Giving a block's pages back after each use and taking fresh ones at
the next pull costs the kernel an allocation and a zeroing per page (about 2 ms per 3 MB here,
25x the copy into resident pages: docs/benchmarks.md, stream_overhead). A `SlotRegion` instead
reserves the address range of every block (private, no memory behind it until written) and
keeps a window (a memfd the node's daemon maps, trainer/wire/host_windows.py) of a few slots, as
many as the stream's window holds blocks at once: fetching a block maps a free slot at the
block's own address (mmap MAP_FIXED of the memfd), releasing it maps the reserve back, and the
slot's pages, untouched, serve the next block. The daemon writes a pull into the slot, found by
`ref`, so pulls still land in place; the trainer's memory for blocks stays the slots'.

A block fetched when every slot is taken (more blocks held than the window said) stays in the
private reserve at its address: correct, with its pulls through the connection's slot, one copy
more; release gives those pages back (MADV_DONTNEED).

Linux only (MAP_FIXED over a reserved range); `SlotRegion.reserve` returns None elsewhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading
from typing import NamedTuple

import torch

from ps_offload.proto import ps_pb2

# Linux's values on x86-64 and arm64 (the mmap module does not export MAP_FIXED or MAP_NORESERVE).
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE, _MAP_POPULATE = (
    0x01,
    0x02,
    0x10,
    0x20,
    0x4000,
    0x8000,
)


class WindowPlace(NamedTuple):
    """Where bytes lie in the node's windows: a LocalRef's fields as a plain tuple, written
    into a request's own `local` field (`into`) rather than built as a message apart, which
    would be a protobuf arena of its own per shard (trainer/wire/local_client.py `_new_batch`)."""

    window: int
    offset: int
    nbytes: int

    def into(self, ref: ps_pb2.LocalRef) -> None:
        ref.window, ref.offset, ref.nbytes = self.window, self.offset, self.nbytes


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class SlotRegion:
    """`nbytes` of reserved addresses (the blocks, each from a page boundary) over `slots`
    slots of `slot_bytes` in window `number` (its memfd `fd`, owned by HostWindows)."""

    def __init__(self, libc, address: int, nbytes: int, *, number: int, fd: int, slots: int, slot_bytes: int) -> None:
        self._libc = libc
        self.address = address
        self.nbytes = nbytes
        self.number = number
        self._fd = fd
        self.slot_bytes = slot_bytes
        self._free = list(range(slots))[::-1]
        self._mapped: dict[int, tuple[int, int]] = {}  # offset in the region -> (slot, bytes)
        self._lock = threading.Lock()
        buffer = (ctypes.c_uint8 * nbytes).from_address(address)
        self.bytes = torch.frombuffer(buffer, dtype=torch.uint8)  # the tensors' storage: keep the region mapped
        self.stats = {"slot_fetches": 0, "reserve_fetches": 0}

    @classmethod
    def reserve(cls, nbytes: int) -> tuple[object, int] | None:
        """(libc, address) of `nbytes` of private, unbacked addresses; None off Linux."""
        if not sys.platform.startswith("linux") or nbytes <= 0:
            return None
        libc = _libc()
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
        address = libc.mmap(None, nbytes, _PROT_RW, flags, -1, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        return libc, address

    def _map(self, offset: int, nbytes: int, fd: int, file_offset: int) -> None:
        # A slot's pages exist already: MAP_POPULATE maps them all in one call, where touching
        # them would fault once per page.
        flags = _MAP_FIXED | (
            _MAP_SHARED | _MAP_POPULATE if fd >= 0 else _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
        )
        got = self._libc.mmap(self.address + offset, nbytes, _PROT_RW, flags, fd, file_offset)
        if got != self.address + offset:
            raise OSError(ctypes.get_errno(), f"mmap of {nbytes} bytes at region offset {offset} failed")

    def fetch(self, tensor: torch.Tensor) -> bool:
        """Gives the block whose values are `tensor` (in this region, from a page boundary)
        memory for its next use: a free slot mapped at its address (True), or, with none free,
        the private reserve there (False). Either way its contents are undefined until pulled."""
        offset, nbytes = self._span(tensor)
        with self._lock:
            if offset in self._mapped:
                return True
            if not self._free:
                self.stats["reserve_fetches"] += 1
                return False
            slot = self._free.pop()
            self._map(offset, nbytes, self._fd, slot * self.slot_bytes)
            self._mapped[offset] = (slot, nbytes)
            self.stats["slot_fetches"] += 1
            return True

    def release(self, tensor: torch.Tensor) -> None:
        """The block is done with its memory: its slot (if it had one) goes back to the free
        ones with its pages as they are, and the reserve is mapped back at its address; a
        block in the reserve gives its pages back."""
        offset, nbytes = self._span(tensor)
        with self._lock:
            held = self._mapped.pop(offset, None)
            if held is None:
                self._libc.madvise(self.address + offset, nbytes, mmap.MADV_DONTNEED)
                return
            self._map(offset, nbytes, -1, 0)
            self._free.append(held[0])

    def ref(self, address: int, nbytes: int) -> WindowPlace | None:
        """Where `nbytes` at `address` lie in the window, if within one block mapped to a slot."""
        if not (self.address <= address and address + nbytes <= self.address + self.nbytes):
            return None
        at = address - self.address
        with self._lock:
            for offset, (slot, span) in self._mapped.items():
                if offset <= at and at + nbytes <= offset + span:
                    where = slot * self.slot_bytes + at - offset
                    return WindowPlace(self.number, where, nbytes)
        return None

    def _span(self, tensor: torch.Tensor) -> tuple[int, int]:
        offset = tensor.data_ptr() - self.address
        nbytes = -(-tensor.numel() * tensor.element_size() // mmap.PAGESIZE) * mmap.PAGESIZE
        if offset % mmap.PAGESIZE or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"a block of {nbytes} bytes at region offset {offset} is not a page-aligned span of it")
        return offset, nbytes
