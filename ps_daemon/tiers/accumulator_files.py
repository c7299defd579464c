"""Accumulators of steps pushed in parts (ps_daemon/store/accumulate.py) on the NVMe tier.

A daemon with an NVMe tier holds models larger than its RAM, and a trainer accumulating
micro-batches keeps one fp32 sum per shard on the daemon until the step's APPLY: 4 bytes per
parameter, as large as the master itself. In anonymous memory those sums would have to fit
in RAM (nothing can page them out: these machines have no swap). Here each sum is the mapping
of a file under the NVMe directory instead, so the kernel writes its pages back to the disk
and reclaims them under memory pressure, and reads them again when the next part is added:
the sums live in the page cache over the NVMe tier, not in the RAM tier.

Each file is unlinked as soon as it is mapped (the mapping keeps it alive): freeing the tensor
frees the file and its dirty pages are dropped, never written; nothing is left behind by a
crash (the files left by a killed daemon's mappings are gone with it; a daemon's start also
clears the directory). The blocks are reserved up front (posix_fallocate), so a full disk is a
clear error at the first part, never a SIGBUS when a page is first written. Not durable, by
design: a restart loses the sums, and the trainer runs the step again (StepLost).
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from pathlib import Path

import torch

from ps_offload.daemon.errors import ResourceExhausted

FP32_BYTES = 4


class AccumulatorFiles:
    in_ram = False  # ps_offload.daemon.tiers.tier.SumStore: the page cache, not the store's RAM

    def __init__(self, nvme_dir: Path) -> None:
        self.dir = Path(nvme_dir) / "accumulators"
        shutil.rmtree(self.dir, ignore_errors=True)  # a killed daemon's, if any
        self.dir.mkdir(parents=True)
        self._names = itertools.count()
        self._lock = threading.Lock()

    def allocate(self, numel: int) -> torch.Tensor:
        """An fp32 tensor of `numel` values backed by a file of its own (contents unset)."""
        with self._lock:
            path = self.dir / f"{next(self._names)}.f32"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, max(numel, 1) * FP32_BYTES)
            except OSError as exc:
                raise ResourceExhausted(
                    f"no room for a {numel * FP32_BYTES}-byte gradient accumulator in {self.dir} ({exc.strerror}): "
                    "free space on the NVMe tier's disk, or push one backward pass per step (no accumulator)"
                ) from exc
            return torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32)
        finally:
            os.close(fd)
            path.unlink()
