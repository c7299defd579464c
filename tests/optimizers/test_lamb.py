"""LAMB on the daemons equals a plain-torch LAMB written here, bit for bit: real daemons, a
model whose parameters the plan would otherwise cut (LAMB asks for whole parameters), two
param groups and a schedule, on the RAM tier and on NVMe; and the plug-in's own step against
the same reference at any thread count."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from ps_offload import trainer
from ps_offload.optimizers import lamb
from ps_offload.proto.plan import layout_params

LR, WEIGHT_DECAY, BETAS, EPS = 2e-2, 0.1, (0.9, 0.99), 1e-6
SHARD_BYTES = 4096  # 1024 values: the 40 x 33 weight would span two shards if cut


def _norm(tensor: torch.Tensor) -> float:
    """The norm LAMB's definition names: the float64 sum of squares, in numpy's pairwise order."""
    return math.sqrt(float(np.square(tensor.double().numpy().ravel()).sum()))


def reference_step(params, state, step, lrs_and_decays, betas=BETAS, eps=EPS):
    """Plain torch, one parameter at a time, each line of lamb's docstring written out."""
    beta1, beta2 = betas
    for p, (m, v), (lr, decay) in zip(params, state, lrs_and_decays, strict=True):
        g = p.grad
        m.copy_(m * beta1 + g * (1 - beta1))
        v.copy_(v * beta2 + g * g * (1 - beta2))
        m_hat = m / (1 - beta1**step)
        v_hat = v / (1 - beta2**step)
        update = m_hat / (torch.sqrt(v_hat) + eps)
        if decay:
            update = update + p.detach() * decay
        w_norm, u_norm = _norm(p.detach()), _norm(update)
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        with torch.no_grad():
            p.copy_(p - update * (lr * ratio))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(17, 40)
        self.b = nn.Linear(40, 33)
        self.norm = nn.LayerNorm(33)
        self.c = nn.Linear(33, 3)

    def forward(self, x):
        return self.c(self.norm(torch.tanh(self.b(torch.tanh(self.a(x))))))


def _no_decay(name: str, param: nn.Parameter) -> bool:
    return param.ndim == 1


def _case():
    torch.manual_seed(0)
    model = Net()
    batches = [(torch.randn(8, 17), torch.randn(8, 3)) for _ in range(5)]
    return model, batches


def _lr(step: int) -> float:
    return LR * (1 - step / 10)


def _reference(model, batches) -> list[torch.Tensor]:
    named = list(model.named_parameters())
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for _, p in named]
    for step, (x, y) in enumerate(batches, start=1):
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        decays = [(_lr(step - 1), 0.0 if _no_decay(n, p) else WEIGHT_DECAY) for n, p in named]
        reference_step([p for _, p in named], state, step, decays)
    return [p.detach().clone() for p in model.parameters()]


def _train(model, batches, daemons, replicas: int = 1) -> list[torch.Tensor]:
    opt = trainer.offload(
        model, daemons=[d.address for d in daemons],
        optimizer=trainer.LAMB(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY), no_weight_decay=_no_decay,
        config=trainer.OffloadConfig(shard_bytes=SHARD_BYTES, audit_every=1, replicas=replicas),
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / 10)
    try:
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            scheduler.step()
        opt.synchronize()
        assert opt.audit.stats.audited == len(batches) and opt.audit.stats.mismatches == 0  # (the parity audit)
        layouts = layout_params([(n, tuple(p.shape), None) for n, p in model.named_parameters()])
        for shard in opt.plan:  # the plan kept every parameter whole
            for layout in layouts:
                inside = shard.offset <= layout.offset < shard.end
                assert not inside or layout.offset + layout.numel <= shard.end, (shard, layout)
        assert any(s.numel > SHARD_BYTES // 4 for s in opt.plan)  # the 40 x 33 weight: a shard of its own
        return [p.detach().clone() for p in model.parameters()]
    finally:
        opt.close()


@pytest.mark.parametrize("tier", ["ram", "nvme", "replicated"])
def test_lamb_on_the_daemons_is_the_plain_torch_reference_bit_for_bit(tier, daemon_factory, tmp_path):
    model, batches = _case()
    want = _reference(_case()[0], batches)
    if tier == "nvme":  # a RAM tier of one shard's arena: every step reloads from disk
        flags = ("--nvme-dir", str(tmp_path / "nvme"), "--create-nvme-dir", "--ram-bytes", "24KiB")
        daemons = [daemon_factory(*flags)]
    else:
        daemons = daemon_factory.together([(), ()])
    got = _train(model, batches, daemons, replicas=2 if tier == "replicated" else 1)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g - w).abs().max()


def test_the_plugins_step_is_the_reference_at_any_thread_count():
    torch.manual_seed(1)
    shape = (300, 257)  # past torch's grain, so more threads split the elementwise loops
    p0, grads = torch.randn(shape), [torch.randn(shape) * 1e-2 for _ in range(3)]
    want = p0.clone().requires_grad_(True)
    state = [(torch.zeros(shape), torch.zeros(shape))]
    for step, g in enumerate(grads, start=1):
        want.grad = g
        reference_step([want], state, step, [(LR, WEIGHT_DECAY)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            got, m, v = p0.clone().view(-1), torch.zeros(p0.numel()), torch.zeros(p0.numel())
            for step, g in enumerate(grads, start=1):
                lamb.lamb_step_(got, g.view(-1), m, v, step=step, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                weight_decay=WEIGHT_DECAY)  # fmt: skip
            assert torch.equal(got.view(shape), want.detach()), count
    finally:
        torch.set_num_threads(threads)


def test_lamb_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="LAMB eps must be > 0, got 0.0"):
        trainer.LAMB(eps=0.0)
    with pytest.raises(ValueError, match=r"LAMB.betas must be two numbers in \[0, 1\)"):
        trainer.LAMB(betas=(0.9, 1.0))
    model = nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="state_dtype='bfloat16' is not one lamb keeps"):
        trainer.offload(model, daemons=["127.0.0.1:1"], optimizer=trainer.LAMB(),
                        config=trainer.OffloadConfig(state_dtype="bfloat16"))  # fmt: skip
