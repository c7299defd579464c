"""The run the snapshot tests cut: an MLP classifier trained STEPS steps with AdamW through
daemons with NVMe tiers, a snapshot taken at step CUT, and the check that a trainer started on
the restored daemons resumes at CUT and ends bit for bit where the uninterrupted run ended."""

from __future__ import annotations

from pathlib import Path

import torch

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.trainer.debug_models import mlp

STEPS = 8
CUT = 4


def teacher_batches():
    """STEPS batches labelled by a linear teacher."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 10, generator=g)
    inputs = [torch.randn(16, 32, generator=g) for _ in range(STEPS)]
    return [(x, (x @ teacher).argmax(dim=1)) for x in inputs]


def fresh_mlp(seed: int = 0):
    torch.manual_seed(seed)
    return mlp((32, 64, 64, 10))  # 6,922 parameters


def _adamw():
    return trainer.AdamW(lr=1e-2, weight_decay=0.1)


def offload_mlp(model, daemons: list[str], shard_bytes: int, optimizer=_adamw):
    """trainer.offload with `optimizer()` (a factory), with retries that outlast a restart."""
    return trainer.offload(
        model, daemons=daemons, optimizer=optimizer(), config=trainer.OffloadConfig(shard_bytes=shard_bytes),
        client=trainer.ClientConfig(retry_seconds=30.0, backoff_seconds=0.05),
    )  # fmt: skip


def resumes_as_uninterrupted(address: str, shard_bytes: int, batches, uninterrupted, optimizer=_adamw) -> None:
    """A trainer started on a restored daemon resumes at the snapshot's step (CUT) and ends bit
    for bit where the uninterrupted run did."""
    resumed = fresh_mlp(seed=7)  # other initial values: the restored ones replace them
    with offload_mlp(resumed, [address], shard_bytes, optimizer) as opt:
        assert opt.step_count == CUT
        for batch in batches[CUT:]:
            train_step(opt, resumed, batch)
        opt.synchronize()
    for (name, ours), theirs in zip(resumed.named_parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(ours, theirs), name


def train_step(opt, model, batch) -> None:
    x, y = batch
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def nvme_daemon(tmp_path: Path, name: str) -> LocalDaemon:
    """A daemon in tmp_path/name with its NVMe directory inside it."""
    return LocalDaemon(tmp_path / name, "--nvme-dir", str(tmp_path / name / "nvme"))


def daemon_args(*daemons: LocalDaemon) -> list[str]:
    """`--daemon ADDRESS` for each, as ps-admin takes them."""
    return [arg for d in daemons for arg in ("--daemon", d.address)]
