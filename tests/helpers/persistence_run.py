"""The run the durability tests put through daemons that restart, crash, are partitioned or
are lost for good: a 24-step MLP classifier trained with AdamW through daemons in 8 KiB
shards, with retries that outlast a restart, and the same run by torch.optim.AdamW(fused=True)
in process, which it must equal bit for bit."""

from __future__ import annotations

import copy

import torch

from ps_offload import trainer
from ps_offload.trainer.debug_models import mlp

STEPS = 24
SHARD_BYTES = 8192
CLIENT = trainer.ClientConfig(retry_seconds=30.0, backoff_seconds=0.05)


def classifier_case():
    """(the MLP, STEPS batches labelled by a linear teacher)."""
    torch.manual_seed(0)
    model = mlp((32, 64, 64, 10))
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 10, generator=g)
    inputs = [torch.randn(16, 32, generator=g) for _ in range(STEPS)]
    return model, [(x, (x @ teacher).argmax(dim=1)) for x in inputs]


def classifier_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def fused_adamw_reference(model, batches):
    """A copy of `model` trained on `batches` in process."""
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for batch in batches:
        opt.zero_grad()
        classifier_loss(reference, batch).backward()
        opt.step()
    return reference


def train_and_synchronize(opt, model, batches):
    for batch in batches:
        opt.zero_grad()
        classifier_loss(model, batch).backward()
        opt.step()
    opt.synchronize()


def offload_adamw(model, address):
    return trainer.offload(
        model, daemons=[address], optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1),
        config=trainer.OffloadConfig(shard_bytes=SHARD_BYTES), client=CLIENT,
    )  # fmt: skip


def assert_same_parameters(model, reference):
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs), name
