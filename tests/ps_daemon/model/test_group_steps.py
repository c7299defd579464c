"""Param groups' settings with each step, in process: ShardOptimizer against torch.optim's
fused AdamW and SGD holding the same param groups, whose lr, weight decay, betas, eps,
momentum and dampening change every step as a scheduler would change them, with shard cuts
anywhere inside parameters; and grad_multiplier on every gradient encoding, through the store.

The model, the schedule and the torch reference (tests/helpers/group_model.py) are the
integration tests' too (tests/integration/test_group_hyperparams.py). Any difference is a bug:
torch.equal.
"""

from __future__ import annotations

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.model.encodings import parse
from ps_offload.daemon.model.optimizer import ShardOptimizer, state_tensors
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.kernels import step_calibration
from ps_offload.optimizers import SGD, AdamW
from ps_offload.proto.plan import layout_params, plan_shards, segments_of
from tests.helpers.group_model import (
    GROUP_OF,
    NUMEL,
    SHAPES,
    TorchReference,
    daemon_groups,
    gradients,
    initial_values,
)
from tests.helpers.payloads import encoded_payload

# What the model is registered with: no push below uses it (every push carries groups).
REGISTERED = {"adamw": AdamW(lr=1e-3, weight_decay=0.5), "sgd": SGD(lr=0.5, momentum=0.5)}


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "torch-kernels"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("shard_numel", [37, 1000, 3072, NUMEL])
def test_shard_optimizer_steps_each_group_with_its_settings_as_torch_does(kind, shard_numel, one_pass, monkeypatch):
    """Either way the daemon steps: its one-pass kernel (kernels/fused_step.py), and torch's
    own kernels, which it keeps on a torch build the kernel does not compute as."""
    if one_pass:
        step_calibration.warm()  # (the daemon's pushes step with torch's kernels until it is done)
        assert step_calibration.ready(kind, torch.float32) is not None
    else:
        monkeypatch.setattr(step_calibration, "ready", lambda optimizer, grad_dtype: None)
    initial = initial_values()
    reference = TorchReference(kind, initial)
    config = REGISTERED[kind]
    layouts = layout_params([(f"p{i}", shape, None) for i, shape in enumerate(SHAPES)])
    flat = torch.cat([t.reshape(-1) for t in initial])
    shards = []
    for shard in plan_shards(NUMEL, shard_numel, 1):
        segments = segments_of(shard, layouts)
        groups = [GROUP_OF[s.param_index] for s in segments]
        optimizer = ShardOptimizer(config, segments, [config.weight_decay] * len(segments), groups, group_count=3)
        optimizer.bind([torch.zeros(shard.numel) for _ in range(state_tensors(config))])
        shards.append((shard, optimizer))
    for step in range(6):
        grads = gradients(step)
        reference.step(step, grads)
        flat_grad = torch.cat([g.reshape(-1) for g in grads])
        for shard, optimizer in shards:
            piece = slice(shard.offset, shard.end)
            optimizer.apply(flat[piece], flat_grad[piece].clone(), config.lr, daemon_groups(kind, step))
    expected = reference.flat()
    assert torch.equal(flat, expected), f"max |diff| {(flat - expected).abs().max().item()}"


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "torch-kernels"])
@pytest.mark.parametrize("shard_numel", [37, 1000, 3072, NUMEL])
def test_bf16_state_steps_each_group_as_torch_does_on_bf16_parameters(shard_numel, one_pass, monkeypatch):
    """bf16 master, m and v (ModelSpec.state_dtype): ShardOptimizer against torch.optim.AdamW
    (fused=True) on the bf16 parameters, either way the daemon steps them
    (kernels/bf16_state_step.py, or torch's kernel), with a grad multiplier on odd steps."""
    if one_pass:
        step_calibration.warm()
        assert step_calibration.ready(step_calibration.BF16_STATE, torch.bfloat16) is not None
    else:
        monkeypatch.setattr(step_calibration, "ready", lambda optimizer, grad_dtype: None)
    initial = initial_values()
    reference = TorchReference("adamw", initial, dtype=torch.bfloat16)
    config = REGISTERED["adamw"]
    layouts = layout_params([(f"p{i}", shape, None) for i, shape in enumerate(SHAPES)])
    flat = torch.cat([t.reshape(-1) for t in initial]).bfloat16()
    shards = []
    for shard in plan_shards(NUMEL, shard_numel, 1):
        segments = segments_of(shard, layouts)
        groups = [GROUP_OF[s.param_index] for s in segments]
        optimizer = ShardOptimizer(
            config, segments, [config.weight_decay] * len(segments), groups, group_count=3, state_dtype=torch.bfloat16
        )
        optimizer.bind([torch.zeros(shard.numel, dtype=torch.bfloat16) for _ in range(2)])
        shards.append((shard, optimizer))
    for step in range(6):
        multiplier = 0.375 if step % 2 else None
        grads = [g.bfloat16() for g in gradients(step)]
        scaled = grads if multiplier is None else [(g.float() * torch.tensor(multiplier)).bfloat16() for g in grads]
        reference.step(step, scaled)  # GradScaler's unscale_ writes the bf16 gradient so
        flat_grad = torch.cat([g.reshape(-1) for g in grads])
        for shard, optimizer in shards:
            piece = slice(shard.offset, shard.end)
            out = torch.empty(shard.numel, dtype=torch.bfloat16)
            optimizer.apply(flat[piece], flat_grad[piece].clone(), config.lr, daemon_groups("adamw", step),
                            multiplier=multiplier, out=out)  # fmt: skip
            assert torch.equal(out.view(torch.int16), flat[piece].view(torch.int16))
    assert torch.equal(flat.view(torch.int16), reference.flat().view(torch.int16))
    for index, name in enumerate(["exp_avg", "exp_avg_sq"]):
        ours = torch.cat([optimizer.state[index] for _, optimizer in shards])
        assert torch.equal(ours.view(torch.int16), reference.flat(name).view(torch.int16)), name


def test_without_groups_the_registered_settings_still_apply():
    """The same pushes without groups step by the registered settings: different values (so
    the test above could tell whether groups were read)."""
    layouts = layout_params([(f"p{i}", shape, None) for i, shape in enumerate(SHAPES)])
    results = []
    for groups in (daemon_groups("adamw", 0), ()):
        (shard,) = plan_shards(NUMEL, NUMEL, 1)
        optimizer = ShardOptimizer(REGISTERED["adamw"], segments_of(shard, layouts), [0.5] * 7, list(GROUP_OF))
        optimizer.bind([torch.zeros(NUMEL), torch.zeros(NUMEL)])
        master = torch.cat([t.reshape(-1) for t in initial_values()])
        optimizer.apply(master, torch.cat([g.reshape(-1) for g in gradients(0)]), 1e-3, groups)
        results.append(master)
    assert not torch.equal(*results)


# -- grad_multiplier through the store ----------------------------------------------------

MULTIPLIER_NUMEL = 3000  # one parameter: shards of 2048 and 952


def _multiplier_store(name: str) -> ShardStore:
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=8192)
    store.registry.register(ModelSpec(name, (ParamSpec("w", (MULTIPLIER_NUMEL,)),), AdamW(lr=0.1), 8192, ("d",)), 0)
    for shard_id, n in enumerate((2048, 952)):
        store.push(PushRequest(name, shard_id, step=0, kind="parameters", data=torch.linspace(-1, 1, n)))
    return store


@pytest.mark.parametrize("encoding", ["raw", "bf16", "fp16", "topk", "onebit"])
@pytest.mark.parametrize("multiplier", [2.0**-16, 0.3, 3.7e5])
def test_grad_multiplier_multiplies_the_decoded_fp32_gradient_by_an_fp32_scalar(encoding, multiplier):
    """As torch.amp.GradScaler's unscale_: the decoded fp32 gradient times the multiplier as
    an fp32 tensor (0.3 is not a float32: multiplying in double and rounding would differ),
    then the optimizer; the same as a RAW push of that product. A RAW payload is left as sent."""
    ours, ref = _multiplier_store("m"), _multiplier_store("m")
    grad = gradients(0, [(2048,)])[0] * 2.0**16 * 0.01
    if encoding == "raw":
        data, sent = grad.clone(), grad.clone()
    else:
        staging, nbytes = encoded_payload(encoding, grad)
        data = parse(encoding, staging, nbytes, 2048, "t")
        grad = data.decompress(torch.empty(2048))
    product = grad * torch.tensor(multiplier, dtype=torch.float32)
    ours.push(PushRequest("m", 0, step=0, kind="gradient", data=data, grad_multiplier=multiplier))
    ref.push(PushRequest("m", 0, step=0, kind="gradient", data=product))
    for a, b in zip(_tensors(ours), _tensors(ref), strict=True):
        assert torch.equal(a, b)
    if encoding == "raw":
        assert torch.equal(data, sent)
    assert not torch.equal(_tensors(ours)[0], torch.linspace(-1, 1, 2048))  # a step was taken


def _tensors(store: ShardStore) -> list[torch.Tensor]:
    shard = store.registry.shard("m", 0)
    return [shard.master, *shard.optimizer.state]
