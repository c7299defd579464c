"""Process-wide memory matters for both ends: the allocator setting for the bulk streams, and
the host's available memory (mem_available).

gRPC Python hands every chunk over as a fresh bytes object of about 1 MiB. glibc serves
blocks that large with mmap and gives them back to the kernel with munmap on free, so every
chunk pays page faults on first touch: measured on loopback, streams ran at 1.3-1.5 GB/s
with the defaults and 2.1-2.4 GB/s once freed chunks stay in the heap (docs/benchmarks.md).
Raising the mmap threshold to glibc's 64-bit maximum (32 MiB) and the trim threshold keeps
them there. Allocations above 32 MiB (shard tensors) still use mmap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_tuned = False


def keep_chunk_buffers_in_heap(*, mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Applies the setting once per process; returns whether glibc accepted it (False on
    other C libraries, where it is simply skipped)."""
    global _tuned
    if _tuned:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("mallopt unavailable; allocator left as is")
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    _tuned = ok
    return ok


def return_freed_blocks(*, mmap_threshold: int = 2 << 20, trim_threshold: int = 16 << 20) -> bool:
    """For a process whose memory must follow what it holds: a trainer streaming blocks
    (trainer/stream/optimizer.py) frees a block after each use and allocates it again, between
    small allocations that live on (activations saved for backward). With the bulk-stream
    setting above, blocks under 32 MiB come from the heap, which then keeps their freed
    space (measured: RSS 167 -> 538 MiB from 8 to 32 blocks of 6.8 MiB, live bytes flat).
    Allocations over `mmap_threshold` (still above the ~1 MiB chunk buffers) use mmap again
    and go back to the kernel when freed. Returns whether glibc accepted it."""
    global _tuned
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    _tuned = _tuned or ok  # a later keep_chunk_buffers_in_heap() must not undo it
    return ok


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The host's MemAvailable in bytes; None where the kernel does not say (not Linux)."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        return None
    return None
