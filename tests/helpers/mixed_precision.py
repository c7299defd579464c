"""Mixed precision the way torch users spell it, for the tests that train bf16 and fp16 models
through daemons: an MLP in the half dtype with learnable batches, the in-process reference
(fp32 masters, torch.optim.AdamW(fused=True) on them, cast back each step, GradScaler's rules
for fp16), the offloaded loop, and the bit-for-bit comparison of parameters and the daemons'
masters. Imported as `mixed`: `mixed.case(dtype)`, `mixed.train_reference(...)`."""

from __future__ import annotations

import torch

from ps_offload import trainer
from ps_offload.trainer.debug_models import mlp
from tests.helpers.training import no_decay

STEPS = 10
LR = 1e-2


def case(dtype: torch.dtype, widths=(33, 129, 17, 10)):
    torch.manual_seed(0)
    model = mlp(widths).to(dtype)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(widths[0], widths[-1], generator=g)  # labels a linear teacher gives: learnable
    inputs = [torch.randn(16, widths[0], generator=g) for _ in range(STEPS)]
    return model, [(x.to(dtype), (x @ teacher).argmax(dim=1)) for x in inputs]


def loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def param_groups(params_named):
    """torch.optim param groups: weight decay 0.1 on matrices, none on the rest."""
    params_named = list(params_named)
    decay = [p for n, p in params_named if p.dim() >= 2]
    undecayed = [p for n, p in params_named if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": undecayed, "weight_decay": 0.0}]


def train_reference(model, batches, *, scaler: trainer.LossScaling | None = None, overflow_at: int = -1):
    """The in-process spelling: fp32 masters, fused AdamW on them, cast back each step; with
    `scaler`, GradScaler's rules on the fp16 gradients, unscaled in fp32."""
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    by_id = {id(p): m for p, m in zip(params, masters, strict=True)}
    groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in param_groups(model.named_parameters())]
    opt = torch.optim.AdamW(groups, lr=LR, fused=True)
    scale, good, skipped = (scaler.init_scale if scaler else 1.0), 0, 0
    for step, batch in enumerate(batches):
        model.zero_grad()
        step_loss = loss(model, batch)
        (step_loss * torch.tensor(scale, dtype=torch.float32) if scaler else step_loss).backward()
        if not scaler:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == overflow_at:
            params[0].grad.view(-1)[3] = float("inf")
        inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
        for p, m in zip(params, masters, strict=True):
            m.grad = p.grad.float() * inv if scaler else p.grad.float()
        if scaler and not all(torch.isfinite(m.grad).all() for m in masters):
            scale, good, skipped = scale * scaler.backoff_factor, 0, skipped + 1
            continue
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
        if scaler:
            good += 1
            if good == scaler.growth_interval:
                scale, good = scale * scaler.growth_factor, 0
    return masters, scale, skipped


def train_offloaded(model, batches, opt, *, overflow_at: int = -1):
    losses = []
    for step, batch in enumerate(batches):
        opt.zero_grad()
        step_loss = loss(model, batch)
        opt.scale_loss(step_loss).backward()
        if opt.loss_scaler is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == overflow_at:
            opt.params[0].grad.view(-1)[3] = float("inf")
        opt.step()
        losses.append(step_loss.item())
    opt.synchronize()
    return losses


def daemon_masters(opt) -> list[torch.Tensor]:
    """The daemons' fp32 master values, per parameter."""
    flat = torch.empty(opt.flat.numel, dtype=torch.float32)
    view = memoryview(flat.numpy()).cast("B")
    for shard in opt.plan:
        opt.client.pull(shard, min_version=0, out=view[shard.offset * 4 : shard.end * 4])
    ranges = [opt.flat.param_range(i) for i in range(len(opt.params))]
    return [flat[a:b].view(p.shape) for p, (a, b) in zip(opt.params, ranges, strict=True)]


def assert_same(model, reference_model, opt, masters):
    """The model's half-precision parameters equal the reference's bit for bit, and so do the
    daemons' masters and the reference's fp32 ones."""
    for (name, ours), theirs in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        assert ours.dtype == theirs.dtype
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), name
    for ours, theirs in zip(daemon_masters(opt), masters, strict=True):
        assert torch.equal(ours, theirs.detach())


def offload_pushing_in_backward(model, daemons, **config):
    """trainer.offload with OffloadConfig(push_in_backward=True), AdamW as the reference steps,
    4 KiB shards over `daemons`; `config` adds offload()'s other arguments."""
    return trainer.offload(
        model, daemons=[d.address for d in daemons], optimizer=trainer.AdamW(lr=LR, weight_decay=0.1),
        no_weight_decay=no_decay, config=trainer.OffloadConfig(shard_bytes=4096, push_in_backward=True),
        **config,
    )  # fmt: skip
