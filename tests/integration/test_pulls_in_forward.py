"""The forward after `step()` never reads a parameter before its pull has landed, however the
model reads it (trainer/offload/forward_waits.py): `nn.MultiheadAttention` reads
`out_proj.weight` without calling `out_proj`, and a module may read a child's weight itself in
eval only (an inference fast path). One shard's pull is slowed down (the transports' pull held
back 0.3 s: the daemon is real); the run still ends bit for bit where torch.optim.AdamW ends,
and an evaluation right after a step gives torch's output. Before the fix, both ended
different from torch (issue 39's silent wrong step)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from ps_offload import trainer
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from ps_offload.trainer.wire.local_client import LocalClient

STEPS = 4
SLOW_SECONDS = 0.3


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


def _case():
    torch.manual_seed(0)
    model = Encoder()
    g = torch.Generator().manual_seed(1)
    return model, [torch.randint(0, 32, (4, 9), generator=g) for _ in range(STEPS)]


def _loss(model, batch):
    return nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, 32), batch[:, 1:].reshape(-1))


@pytest.fixture
def slowed(monkeypatch):
    """slowed(ids): every later pull of those shards (after the first step) waits first."""
    shards: set[int] = set()
    for cls in (LocalClient, DataPlaneClient):
        original = cls.pull_into

        def pull_into(self, pull, *args, _original=original, **kwargs):
            if pull.shard_id in shards and pull.request.min_version > 0:
                time.sleep(SLOW_SECONDS)
            return _original(self, pull, *args, **kwargs)

        monkeypatch.setattr(cls, "pull_into", pull_into)
    return shards.update


def _last_shard_of(opt, name: str) -> int:
    names = [n for n, _ in opt._model.named_parameters()]
    start, end = opt.flat.param_range(names.index(name))
    return max(s.shard_id for s in opt.plan if s.offset < end and start < s.end)


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_out_proj_read_by_the_attention_waits_for_its_pull(daemon, slowed, transport):
    model, batches = _case()
    reference = copy.deepcopy(model)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    for batch in batches:
        ropt.zero_grad()
        _loss(reference, batch).backward()
        ropt.step()
    opt = trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-3),
        config=trainer.OffloadConfig(shard_bytes=4096, model_name=f"fw-{transport}"),
        client=trainer.ClientConfig(transport=transport),
    )  # fmt: skip
    with opt:
        # Its last shard also holds linear1's first elements, whose forward comes after the
        # attention's: the attention reads out_proj.weight while that pull is held back.
        slowed({_last_shard_of(opt, "enc.layers.0.self_attn.out_proj.weight")})
        for batch in batches:
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()
        opt.synchronize()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs), name


class FusedInEval(nn.Module):
    """Calls its child while training; in eval without grad, reads the child's weight itself
    (as inference fast paths do: torch turns its own off when a module has hooks, others may
    not)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 32)
        self.proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.training or torch.is_grad_enabled():
            h = self.proj(h)
        else:
            h = nn.functional.linear(h, self.proj.weight, self.proj.bias)
        return self.head(torch.relu(h))


def test_an_evaluation_right_after_a_step_reads_the_new_parameters(daemon, slowed):
    torch.manual_seed(0)
    model = FusedInEval()
    _, batches = _case()
    reference = copy.deepcopy(model)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    opt = trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-3),
        config=trainer.OffloadConfig(shard_bytes=4096, model_name="fw-eval"),
    )  # fmt: skip
    with opt:
        slowed({_last_shard_of(opt, "proj.weight")})
        for step, batch in enumerate(batches):
            for m, o in ((model, opt), (reference, ropt)):
                o.zero_grad()
                _loss(m, batch).backward()
                o.step()
            model.eval()
            reference.eval()
            with torch.no_grad():  # the first one waits for every pull, the next ones at the root
                assert torch.equal(model(batch[:, :-1]), reference(batch[:, :-1])), f"evaluation after step {step}"
            model.train()
            reference.train()
