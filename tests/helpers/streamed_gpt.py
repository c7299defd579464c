"""The tiny GPT the streaming tests train through daemons one block at a time, and the same GPT
trained in process the way torch users spell it (an fp32 master, torch.optim.AdamW(fused=True)
on it, the master cast back into the model's dtype), accumulating micro-batches as the daemons
do: each micro-batch's gradient widened and added into an fp32 sum in micro-batch order."""

from __future__ import annotations

import torch

from ps_offload.trainer.debug_models import GPTConfig, TinyGPT
from tests.helpers.training import no_decay

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16)
LR = 1e-2
STEPS = 3


def gpt_batches(micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """STEPS steps of `micro` micro-batches each: (tokens, targets)."""
    g = torch.Generator().manual_seed(7)
    return [
        [(torch.randint(CONFIG.vocab_size, (2, CONFIG.block_size), generator=g),) * 2 for _ in range(micro)]
        for _ in range(STEPS)
    ]


def train_in_process(dtype, batches, cls=TinyGPT, clip=None):
    """Returns (the initial state_dict, the trained parameters by name, every micro-batch's loss)."""
    torch.manual_seed(0)
    model = cls(CONFIG).to(dtype)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    decay = [m for (n, p), m in zip(model.named_parameters(), masters, strict=True) if not no_decay(n, p)]
    rest = [m for (n, p), m in zip(model.named_parameters(), masters, strict=True) if no_decay(n, p)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=LR, fused=True)
    losses = []
    for micro_batches in batches:
        sums = [None] * len(params)
        for idx, targets in micro_batches:
            model.zero_grad(set_to_none=True)
            _, loss = model(idx, targets)
            (loss / len(micro_batches)).backward()
            for i, p in enumerate(params):
                g = p.grad.float()
                sums[i] = g.clone() if sums[i] is None else sums[i].add_(g)
            losses.append(loss.item())
        if clip is not None:  # torch's clip on the step's gradient (here the fp32 sum the daemons hold)
            torch.nn.utils.clip_grad_norm_(_masters_with(masters, sums), clip)
        for m, s in zip(masters, sums, strict=True):
            m.grad = s
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m.to(dtype))
    return initial, {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _masters_with(masters, sums):
    for m, s in zip(masters, sums, strict=True):
        m.grad = s
    return masters


def copy_init(initial, model):
    """Streaming.init: each module's own parameters and buffers from the reference's initial state."""
    names = {id(m): n for n, m in model.named_modules()}

    def init(module):
        prefix = names[id(module)]
        with torch.no_grad():
            for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                t.copy_(initial[f"{prefix}.{name}" if prefix else name])

    return init
