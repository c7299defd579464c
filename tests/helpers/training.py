"""Training cases and loops that compare a model trained through daemons with the same model
trained by torch.optim in process: an MLP and a tiny transformer with learnable batches, the
two loops, the usual no-weight-decay rule, and a Linear trained through one daemon for the
tests that only need shards with versions on them."""

from __future__ import annotations

import torch

from ps_offload import trainer
from ps_offload.trainer.debug_models import GPTConfig, TinyGPT, mlp

STEPS = 50


def mlp_case():
    torch.manual_seed(0)
    model = mlp((32, 64, 64, 10))
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 10, generator=g)  # labels a linear teacher gives: learnable
    inputs = [torch.randn(16, 32, generator=g) for _ in range(STEPS)]
    batches = [(x, (x @ teacher).argmax(dim=1)) for x in inputs]

    def loss_fn(m, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(m(x), y)

    return model, batches, loss_fn


def gpt_case():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=4, n_embd=64))
    g = torch.Generator().manual_seed(1)
    # Sequences that follow a rule (next = 7 * prev + 3 mod 40): learnable, so the loss falls.
    starts = [torch.randint(40, (4, 1), generator=g) for _ in range(STEPS)]
    batches = []
    for start in starts:
        seq = [start]
        for _ in range(32):
            seq.append((seq[-1] * 7 + 3) % 40)
        batches.append(torch.cat(seq, dim=1))

    def loss_fn(m, batch):
        return m(batch[:, :-1], batch[:, 1:])[1]

    return model, batches, loss_fn


def no_decay(name, p):
    """The usual rule: biases and norms' weights (under 2 dimensions) take no weight decay."""
    return p.dim() < 2


def train_reference(model, batches, loss_fn, torch_opt):
    for batch in batches:
        torch_opt.zero_grad()
        loss_fn(model, batch).backward()
        torch_opt.step()
    return model


def train_offloaded(model, batches, loss_fn, opt):
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    opt.synchronize()
    return losses


def train_linear(address: str, steps: int) -> list:
    """nn.Linear(64, 40) trained `steps` steps through one daemon (2600 parameters: 3 shards of
    4 KiB, each at version `steps`); returns the plan."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 40)
    with trainer.offload(
        model,
        daemons=[address],
        optimizer=trainer.AdamW(lr=1e-2),
        config=trainer.OffloadConfig(shard_bytes=4096),
    ) as opt:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
        opt.synchronize()
        return list(opt.plan)
