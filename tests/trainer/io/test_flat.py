"""trainer/io/flat.py and trainer/pipeline/local_optimizer.py: parameters and gradients as views into flat buffers at
the plan's offsets, and the in-process optimizer behind the one interface."""

from __future__ import annotations

import torch

from ps_offload import trainer
from ps_offload.proto.plan import layout_params
from ps_offload.trainer.io.flat import FlatParams
from ps_offload.trainer.pipeline.local_optimizer import StepOptimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))


def test_parameters_and_gradients_are_views_at_the_plans_offsets():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat = FlatParams(model.named_parameters())
    layouts = layout_params([(n, tuple(p.shape), None) for n, p in model.named_parameters()])
    assert [(la.offset, la.numel) for la in flat.layouts] == [(la.offset, la.numel) for la in layouts]
    for index, (name, p) in enumerate(model.named_parameters()):
        start, end = flat.param_range(index)
        assert torch.equal(p, before[name])
        assert p.data_ptr() == flat.values[start:end].data_ptr()
        assert p.grad.data_ptr() == flat.grads[start:end].data_ptr()
    model(torch.ones(2, 8)).sum().backward()
    assert flat.grads.abs().sum() > 0  # autograd wrote into the buffer


def test_a_replaced_or_missing_grad_is_adopted_back():
    model = _model()
    flat = FlatParams(model.named_parameters())
    weight, bias = model[0].weight, model[0].bias
    weight.grad = torch.full_like(weight, 2.0)  # someone else's tensor
    bias.grad = None
    flat.grads.fill_(7.0)
    flat.adopt_grads()
    assert torch.equal(weight.grad, torch.full_like(weight, 2.0))
    assert weight.grad.data_ptr() == flat.grads.data_ptr()  # the first parameter, at offset 0
    assert torch.equal(bias.grad, torch.zeros_like(bias))
    flat.zero_grads()
    assert not flat.grads.any()


def test_local_optimizer_is_torchs_fused_adamw_behind_the_step_interface():
    model, reference = _model(), _model()
    nwd = lambda name, p: p.dim() < 2  # noqa: E731
    opt = trainer.LocalOptimizer(model, optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1), no_weight_decay=nwd)
    assert isinstance(opt, StepOptimizer)
    decay = [p for n, p in reference.named_parameters() if not nwd(n, p)]
    other = [p for n, p in reference.named_parameters() if nwd(n, p)]
    torch_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=1e-2, fused=True
    )
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 8, generator=g)
        opt.lr = 1e-2 / (step + 1)
        for group in torch_opt.param_groups:
            group["lr"] = opt.lr
        opt.zero_grad()
        torch_opt.zero_grad()
        model(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        opt.step()
        torch_opt.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    opt.synchronize()
    opt.close()
