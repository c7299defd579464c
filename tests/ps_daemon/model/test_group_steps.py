"""Param groups' settings with each step, in process: ShardOptimizer against torch.optim's
fused AdamW and SGD holding the same param groups, whose lr, weight decay, betas, eps,
momentum and dampening change every step as a scheduler would change them, with shard cuts
anywhere inside parameters; and grad_multiplier on every gradient encoding, through the store.

The helpers (the model, the schedule, the torch reference) are the integration test's too
(tests/integration/test_group_hyperparams.py). Any difference is a bug: torch.equal.
"""

from __future__ import annotations

import pytest
import torch

from ps_offload.daemon.model.encodings import parse
from ps_offload.daemon.model.optimizer import ShardOptimizer, state_tensors
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.kernels import step_calibration
from ps_offload.optimizers import SGD, AdamW, GroupSettings
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import layout_params, plan_shards, segments_of
from tests.ps_daemon.store.test_compressed_push import _payload

# Odd sizes (91, 13, 1, 4329, 333, 2331, 7: 7105 elements), so cuts land at offsets that are
# not multiples of 8 inside parameters, in three groups that interleave in the flat layout.
SHAPES = ((13, 7), (13,), (1,), (333, 13), (333,), (7, 333), (7,))
GROUP_OF = (0, 1, 2, 0, 1, 0, 2)
NUMEL = 7105
# What the model is registered with: no push below uses it (every push carries groups).
REGISTERED = {"adamw": AdamW(lr=1e-3, weight_decay=0.5), "sgd": SGD(lr=0.5, momentum=0.5)}


def settings(kind: str, step: int, group: int) -> dict:
    """Group `group`'s torch.optim settings for `step`: each changes from step to step and
    differs between groups (decaying lr, growing weight decay, moving betas and momentum)."""
    decay = (0.1, 0.0, 0.02, 0.3)[group] * (1 + step / 4)
    if kind == "adamw":
        betas = (0.9 - 0.05 * group + 0.01 * step, 0.999 - 0.004 * group - 0.001 * step)
        return dict(
            lr=3e-3 * (1 + group) * 0.8**step, weight_decay=decay, betas=betas, eps=1e-8 * 10**group * (1 + step)
        )
    return dict(
        lr=0.05 * (1 + group) * 0.9**step,
        weight_decay=decay / 100,
        momentum=0.9 - 0.1 * group - 0.02 * step,
        dampening=0.05 * group + 0.02 * step,
    )


def daemon_groups(kind: str, step: int, count: int = 3) -> tuple[GroupSettings, ...]:
    return tuple(GroupSettings(**_fields(settings(kind, step, g))) for g in range(count))


def proto_groups(kind: str, step: int, count: int = 3) -> list[ps_pb2.GroupHyperparams]:
    return [ps_pb2.GroupHyperparams(**_fields(settings(kind, step, g))) for g in range(count)]


def _fields(torch_settings: dict) -> dict:
    fields = dict(torch_settings)
    if "betas" in fields:
        fields["beta1"], fields["beta2"] = fields.pop("betas")
    return fields


def initial_values(shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in shapes]


def gradients(step: int, shapes=SHAPES) -> list[torch.Tensor]:
    """Gradients over several orders of magnitude (so that the kernels' two loops' roundings
    show), below 0.4 so that times 2**16 they still fit fp16."""
    g = torch.Generator().manual_seed(100 + step)
    return [
        (torch.rand(shape, generator=g) - 0.5) * 0.8 * 10.0 ** torch.randint(-4, 1, shape, generator=g).float()
        for shape in shapes
    ]


class Reference:
    """torch.optim.AdamW / SGD (fused=True) on fp32 copies, one param group per group index."""

    def __init__(self, kind: str, initial: list[torch.Tensor], group_of=GROUP_OF, dtype=torch.float32) -> None:
        self.kind, self.group_of = kind, group_of
        self.params = [t.to(dtype, copy=True).requires_grad_() for t in initial]
        count = max(group_of) + 1
        groups = [
            {
                "params": [p for p, g in zip(self.params, group_of, strict=True) if g == group],
                **settings(kind, 0, group),
            }
            for group in range(count)
        ]
        self.optimizer = (
            torch.optim.AdamW(groups, fused=True) if kind == "adamw" else torch.optim.SGD(groups, fused=True)
        )

    def step(self, step: int, grads: list[torch.Tensor]) -> None:
        for index, group in enumerate(self.optimizer.param_groups):
            group.update(settings(self.kind, step, index))  # as a scheduler does between steps
        for p, grad in zip(self.params, grads, strict=True):
            p.grad = grad.to(p.dtype, copy=True)
        self.optimizer.step()

    def flat(self, state: str = "") -> torch.Tensor:
        """The parameters (or a state tensor, "exp_avg"...) flattened in layout order."""
        tensors = [self.optimizer.state[p][state] if state else p for p in self.params]
        return torch.cat([t.detach().reshape(-1) for t in tensors])


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
    reference = Reference(kind, initial)
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
    reference = Reference("adamw", initial, dtype=torch.bfloat16)
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
    store = ShardStore(ram_bytes=1 << 30, default_shard_bytes=8192)
    store.register(ModelSpec(name, (ParamSpec("w", (MULTIPLIER_NUMEL,)),), AdamW(lr=0.1), 8192, ("d",)), 0)
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
        staging, nbytes = _payload(encoding, grad)
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
    shard = store.shard("m", 0)
    return [shard.master, *shard.optimizer.state]
