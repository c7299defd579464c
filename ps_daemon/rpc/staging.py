"""Reusable staging buffers for incoming pushes.

A push's payload must be complete before it is applied (a broken stream must not leave
half an update), so it is first copied into a staging tensor. Allocating a fresh 64 MiB
tensor per push costs page faults on every first touch; keeping a few freed buffers per
size avoids that. Bounded: at most `max_bytes` are kept idle.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator

import torch

STAGING_OFFSET = 768  # fp32 elements = 3 KiB


class StagingPool:
    def __init__(self, *, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self, numel: int) -> Iterator[torch.Tensor]:
        """An fp32 tensor of `numel` elements (contents undefined) for the block's duration."""
        with self._lock:
            free = self._idle.get(numel)
            if free:
                buffer = free.pop()
                self._idle_bytes -= numel * 4
            else:
                buffer = None
        if buffer is None:
            # Starts 3 KiB into its allocation: the fourth stream of the optimizer step, apart
            # from master, m and v modulo 4 KiB (ps_offload.daemon.store.shard.ARENA_STAGGER says why).
            buffer = torch.empty(numel + STAGING_OFFSET, dtype=torch.float32)[STAGING_OFFSET:]
        try:
            yield buffer
        finally:
            with self._lock:
                if self._idle_bytes + numel * 4 <= self.max_bytes:
                    self._idle[numel].append(buffer)
                    self._idle_bytes += numel * 4

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes
