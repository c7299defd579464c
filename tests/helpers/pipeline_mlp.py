"""The pp x dp run: an MLP cut into pipeline stages, its batches and loss (shared by the
torchrun worker, tests/integration/pp_dp_worker.py, and the in-process references the tests
compare with), the run's shape (STEPS, PP, DP, MICROBATCHES), and torchrun(), which starts
the worker on PP * DP gloo processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from ps_offload.trainer.debug_models import mlp

SIZES = (32, 64, 64, 64, 10)
GLOBAL_BATCH = 16
STEPS = 5
PP, DP, MICROBATCHES = 2, 2, 4  # as torchrun starts the worker


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, SIZES[0], generator=g), torch.randint(10, (GLOBAL_BATCH,), generator=g))
            for _ in range(steps)]  # fmt: skip


def layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return list(mlp(SIZES))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.float(), target)


def torchrun(out: Path, *args: str) -> subprocess.CompletedProcess:
    """The worker on 4 processes (--pp 2 --dp 2, STEPS steps, results in `out`), `args` added."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "-m", "tests.integration.pp_dp_worker", "--pp", "2", "--dp", "2", "--steps", str(STEPS),
         "--out", str(out), *args],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
