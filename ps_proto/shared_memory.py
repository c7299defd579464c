"""Host memory a trainer shares with its node's daemon (the local transport): memfds, sealed,
mapped by both ends. The daemon's side is ps_offload.daemon.dataplane.local_pool, the
trainer's ps_offload.trainer.wire.host_windows; both map through SharedMapping.

A memfd has no name in the filesystem (nothing to clean up after a crash, nothing another
user can open), and its pages go back to the kernel once the last mapping and descriptor are
gone, so a dead process's memory is reclaimed when its peer closes the connection. It is
sealed against shrinking and growing: truncated under a mapping, a read would kill the
reader with SIGBUS.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

import torch

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(nbytes: int, name: str) -> int:
    """A new memfd of `nbytes` (at least one), sealed at that size; the caller closes it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedMappingError(ValueError):
    """The descriptor is not a memory the other end may safely map."""


class SharedMapping:
    """`fd` mapped read-write; `bytes` is a uint8 tensor over the whole mapping. The fd is
    not kept (the mapping holds the memory); close() unmaps."""

    def __init__(self, fd: int) -> None:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size <= 0:
            raise SharedMappingError("shared memory must be a memfd of at least one byte")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            raise SharedMappingError("shared memory must be a memfd sealed with F_SEAL_SHRINK (MFD_ALLOW_SEALING)")
        self.size = info.st_size
        self._map = mmap.mmap(fd, self.size)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # (size,) over the mapping
        self.address = self.bytes.data_ptr()

    def write(self, data: memoryview) -> None:
        """`data` at the start: torch's copy (threads for large ones) unless it is read-only,
        which torch will not wrap."""
        if data.readonly:
            self._map[: len(data)] = data
        elif len(data):
            self.bytes[: len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))

    def close(self) -> None:
        if self._map.closed:
            return
        del self.bytes  # the tensor exports the mapping: it must go before munmap
        self._map.close()
