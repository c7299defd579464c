"""A model moved, cast or re-created after offload(): the optimizer adopts the new tensors and
trains them exactly as if nothing had moved, or refuses before anything is pushed, naming the
parameter and what changed (ps_offload.trainer.offload.param_binding; issue: `model.to()` after the
optimizer was built used to leave the model computing with tensors nobody updated)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import ps_offload
from ps_offload.trainer.io.device import byte_view
from ps_offload.trainer.offload.param_binding import ParameterChanged

_names = itertools.count()


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 64), nn.Tanh(), nn.Linear(64, 3))


def _offload(model: nn.Module, daemons: list[str], **config):
    return ps_offload.offload(
        model, daemons=daemons, optimizer=ps_offload.AdamW(lr=1e-2),
        config=ps_offload.OffloadConfig(model_name=f"binding-{next(_names)}", shard_bytes=4096, **config),
    )  # fmt: skip


def _train(model: nn.Module, opt, steps: int) -> list[float]:
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 48).to(next(model.parameters()).dtype)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.synchronize()
    return losses


def _reference(daemons: list[str], *runs: int, **config) -> dict[str, torch.Tensor]:
    """The model trained without a move, in runs of the same lengths (each run's data starts
    from the same seed)."""
    model = _model()
    with _offload(model, daemons, **config) as opt:
        for steps in runs:
            _train(model, opt, steps)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _masters(opt) -> torch.Tensor:
    """The daemons' fp32 master values of the whole model, in the flat layout."""
    out = torch.zeros(opt.plan[-1].end, dtype=torch.float32)
    view = byte_view(out)
    for shard in opt.plan:
        opt.client.pull(shard, min_version=0, out=view[shard.offset * 4 : shard.end * 4])
    return out


@pytest.mark.parametrize(
    "move",
    [
        pytest.param(lambda m: m.to("cpu:0"), id="to-cpu:0"),
        pytest.param(lambda m: m.double().float(), id="double-then-float"),
        pytest.param(lambda m: m.load_state_dict(copy.deepcopy(m.state_dict()), assign=True), id="assign-same-values"),
        pytest.param(lambda m: m.__setitem__(2, copy.deepcopy(m[2])), id="submodule-re-created"),
    ],
)
def test_a_model_moved_after_offload_trains_as_if_it_had_not_moved(daemons, move):
    model = _model()
    opt = _offload(model, daemons)
    _train(model, opt, 2)
    move(model)
    losses = _train(model, opt, 3)
    opt.close()
    assert opt.step_count == 5
    assert losses[-1] < losses[0]
    for name, value in _reference(daemons, 2, 3).items():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    # The optimizer's param groups hold the model's own Parameter objects again.
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}


@pytest.mark.parametrize(
    "move",
    [pytest.param(lambda m: m.to("cpu:0"), id="to-cpu:0"), pytest.param(lambda m: m.to(torch.bfloat16), id="bf16")],
)
def test_push_in_backward_follows_the_move(daemons, move):
    """The early-push hooks move to the adopted tensors; the step that finds the move is
    pushed whole (its early parts came from the old buffer), later steps early again."""
    model = _model()
    opt = _offload(model, daemons, push_in_backward=True)
    _train(model, opt, 2)
    move(model)
    _train(model, opt, 3)
    opt.close()
    assert opt.step_count == 5
    moved = dict(model.named_parameters())
    for name, value in _reference(daemons, 2, 3, push_in_backward=True).items():
        if moved[name].dtype == torch.float32:
            assert torch.equal(moved[name], value), name
    reference = _model()
    with _offload(reference, daemons) as plain:  # pushing early or not trains the same
        _train(reference, plain, 2)
        move(reference)
        _train(reference, plain, 3)
    for name, value in reference.named_parameters():
        assert torch.equal(moved[name], value), name


def test_a_model_cast_to_bf16_and_back_computes_on_the_daemons_masters(daemons):
    model = _model()
    opt = _offload(model, daemons)
    _train(model, opt, 2)
    model.to(torch.bfloat16)
    _train(model, opt, 2)
    opt.synchronize()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert flat.dtype == torch.bfloat16
    masters = _masters(opt)
    assert torch.equal(opt.flat.values, masters.to(torch.bfloat16)), "the bf16 copy is the master rounded"
    model.float()  # back: the compute copy is the fp32 master itself, not the widened bf16 values
    _train(model, opt, 1)
    opt.synchronize()
    assert torch.equal(opt.flat.values, _masters(opt))
    assert opt.step_count == 5
    opt.close()


def test_new_weights_assigned_after_offload_are_refused_before_any_push(daemons):
    model = _model()
    opt = _offload(model, daemons)
    _train(model, opt, 1)
    before = _masters(opt)
    model.load_state_dict(_model(seed=7).state_dict(), assign=True)  # other values: a checkpoint
    model(torch.randn(2, 48)).sum().backward()
    with pytest.raises(ParameterChanged) as raised:
        opt.step()
    message = str(raised.value)
    assert "'0.weight'" in message and "new Parameter object" in message and "differ" in message
    assert "Nothing was pushed" in message
    assert opt.step_count == 1
    assert torch.equal(_masters(opt), before)  # the daemons applied nothing
    opt.close()


def test_untied_weights_are_refused(daemons):
    model = _model()
    model.append(nn.Linear(64, 3))
    model[3].weight = model[2].weight  # tied: one parameter under two names
    opt = _offload(model, daemons)
    x = torch.randn(4, 48)
    (model[:3](x).sum() + model[3](model[1](model[0](x))).sum()).backward()
    opt.step()
    opt.zero_grad()
    model[3].weight = nn.Parameter(model[2].weight.detach().clone())
    model[:3](x).sum().backward()
    with pytest.raises(ParameterChanged, match=r"'3.weight'.*tied weights untied"):
        opt.step()
    opt.close()


@pytest.mark.parametrize(
    ("move", "says"),
    [
        (lambda m: m[0].double(), "moved in part"),
        (lambda m: m.half(), "float16, which needs the loss scaling"),
        (lambda m: m.double(), "float64: offload\\(\\) trains"),
    ],
)
def test_moves_the_optimizer_cannot_follow_are_refused(daemons, move, says):
    model = _model()
    opt = _offload(model, daemons)
    model(torch.randn(2, 48)).sum().backward()
    move(model)
    with pytest.raises(ParameterChanged, match=says):
        opt.step()
    assert opt.step_count == 0
    opt.close()
