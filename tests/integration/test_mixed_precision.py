"""bf16 and fp16 models through real daemons equal, bit for bit, the same models trained in
process the way torch users spell mixed precision: an fp32 master copy of every parameter,
torch.optim.AdamW(fused=True) on the masters, and the masters cast back into the half-precision
parameters after each step (fp16 with dynamic loss scaling, unscaled in fp32).

Why it can be exact: the trainer pushes its half-precision gradients as they are and the daemon
widens them to fp32 (exact), runs the same fused kernel on the same fp32 values (ps_daemon/
model/optimizer.py), and rounds its master to the compute dtype as Tensor.to does when the trainer pulls.
The CPU runs the whole path; DeviceConfig(staging="always") runs it through the host buffers an
accelerator uses.
"""

from __future__ import annotations

import copy

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.trainer.debug_models import mlp

STEPS = 10
LR = 1e-2


def _case(dtype: torch.dtype, widths=(33, 129, 17, 10)):
    torch.manual_seed(0)
    model = mlp(widths).to(dtype)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(widths[0], widths[-1], generator=g)  # labels a linear teacher gives: learnable
    inputs = [torch.randn(16, widths[0], generator=g) for _ in range(STEPS)]
    return model, [(x.to(dtype), (x @ teacher).argmax(dim=1)) for x in inputs]


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def _groups(params_named):
    params_named = list(params_named)
    decay = [p for n, p in params_named if p.dim() >= 2]
    no_decay = [p for n, p in params_named if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _no_decay(name, p):
    return p.dim() < 2


def _train_reference(model, batches, *, scaler: trainer.LossScaling | None = None, overflow_at: int = -1):
    """The in-process spelling: fp32 masters, fused AdamW on them, cast back each step; with
    `scaler`, GradScaler's rules on the fp16 gradients, unscaled in fp32."""
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    by_id = {id(p): m for p, m in zip(params, masters, strict=True)}
    groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in _groups(model.named_parameters())]
    opt = torch.optim.AdamW(groups, lr=LR, fused=True)
    scale, good, skipped = (scaler.init_scale if scaler else 1.0), 0, 0
    for step, batch in enumerate(batches):
        model.zero_grad()
        loss = _loss(model, batch)
        (loss * torch.tensor(scale, dtype=torch.float32) if scaler else loss).backward()
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


def _train_offloaded(model, batches, opt, *, overflow_at: int = -1):
    losses = []
    for step, batch in enumerate(batches):
        opt.zero_grad()
        loss = _loss(model, batch)
        opt.scale_loss(loss).backward()
        if opt.loss_scaler is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == overflow_at:
            opt.params[0].grad.view(-1)[3] = float("inf")
        opt.step()
        losses.append(loss.item())
    opt.synchronize()
    return losses


def _masters(opt) -> list[torch.Tensor]:
    """The daemons' fp32 master values, per parameter."""
    flat = torch.empty(opt.flat.numel, dtype=torch.float32)
    view = memoryview(flat.numpy()).cast("B")
    for shard in opt.plan:
        opt.client.pull(shard, min_version=0, out=view[shard.offset * 4 : shard.end * 4])
    ranges = [opt.flat.param_range(i) for i in range(len(opt.params))]
    return [flat[a:b].view(p.shape) for p, (a, b) in zip(opt.params, ranges, strict=True)]


def _assert_same(model, reference_model, opt, masters):
    for (name, ours), theirs in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        assert ours.dtype == theirs.dtype
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), name
    for ours, theirs in zip(_masters(opt), masters, strict=True):
        assert torch.equal(ours, theirs.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("n_daemons", "shard_bytes", "staging"),
    [(1, 4096, "auto"), (2, 8192, "auto"), (2, 4096, "always")],
    ids=["1-daemon-4k", "2-daemons-8k", "2-daemons-4k-staged"],
)
def test_half_precision_through_daemons_equals_fp32_master_in_process(
    dtype, n_daemons, shard_bytes, staging, daemon_factory
):
    model, batches = _case(dtype)
    reference = copy.deepcopy(model)
    scaling = trainer.LossScaling(growth_interval=3) if dtype == torch.float16 else None
    masters, _, _ = _train_reference(reference, batches, scaler=scaling)

    daemons = [daemon_factory() for _ in range(n_daemons)]
    with trainer.offload(
        model,
        daemons=[d.address for d in daemons],
        optimizer=trainer.AdamW(lr=LR, weight_decay=0.1),
        no_weight_decay=_no_decay,
        config=trainer.OffloadConfig(shard_bytes=shard_bytes),
        device=trainer.DeviceConfig(staging=staging, host_buffers=2),
        loss_scaling=scaling,
    ) as opt:
        assert len(opt.plan) >= 2 * n_daemons  # shards cut through parameters
        assert opt.host_buffer_bytes == (2 * max(s.numel for s in opt.plan) * 2 if staging == "always" else 0)
        # Staged: no more transfers at once than buffers (2 daemons would give 4 I/O threads).
        assert opt.io.workers == (2 if staging == "always" else max(2, 2 * n_daemons))
        losses = _train_offloaded(model, batches, opt)
        assert losses[-1] < losses[0]
        _assert_same(model, reference, opt, masters)


def test_fp16_overflow_skips_the_step_and_backs_off_the_scale(daemon_factory):
    model, batches = _case(torch.float16)
    reference = copy.deepcopy(model)
    scaling = trainer.LossScaling(growth_interval=2)
    masters, scale, skipped = _train_reference(reference, batches, scaler=scaling, overflow_at=3)
    assert skipped == 1

    daemon = daemon_factory()
    with trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=LR, weight_decay=0.1),
        no_weight_decay=_no_decay, config=trainer.OffloadConfig(shard_bytes=4096), loss_scaling=scaling,
    ) as opt:  # fmt: skip
        _train_offloaded(model, batches, opt, overflow_at=3)
        # The skipped step moved no version: STEPS - 1 updates on every shard.
        assert opt.step_count == STEPS - 1
        assert opt.loss_scaler.skipped_steps == 1 and opt.loss_scaler.scale == scale
        versions = {opt.client.pull(s, min_version=0, out=memoryview(bytearray(s.numel * 4))) for s in opt.plan}
        assert versions == {STEPS - 1}
        _assert_same(model, reference, opt, masters)


def _bytes_pulled(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10).bytes_pulled


def test_bf16_pulls_move_half_the_bytes_of_fp32_pulls(daemon_factory):
    pulled = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, batches = _case(dtype)
        daemon = daemon_factory()
        with trainer.offload(
            model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=LR),
            config=trainer.OffloadConfig(shard_bytes=4096),
        ) as opt:  # fmt: skip
            before = _bytes_pulled(daemon.address)
            _train_offloaded(model, batches[:3], opt)
            pulled[dtype] = _bytes_pulled(daemon.address) - before
    assert pulled[torch.float32] == 3 * 4 * opt.flat.numel
    assert pulled[torch.bfloat16] * 2 == pulled[torch.float32]


def test_a_model_on_two_dtypes_or_devices_is_refused_before_registering():
    model = mlp((8, 8, 4))
    model[0].to(torch.bfloat16)
    with pytest.raises(ValueError, match="share one device and one dtype"):
        trainer.offload(model, daemons=["127.0.0.1:1"], optimizer=trainer.AdamW())


def test_compressed_pushes_of_a_bf16_model(daemon_factory):
    """The compressor widens bf16 gradients exactly and keeps fp32 error feedback: with bf16
    compression a bf16 gradient loses nothing (the error stays zero), so training equals the
    uncompressed mixed-precision reference bit for bit; 1-bit Adam sends a 32nd of fp32's
    bytes after its warm-up and still learns."""
    model, batches = _case(torch.bfloat16)
    reference = copy.deepcopy(model)
    masters, _, _ = _train_reference(reference, batches)
    daemon = daemon_factory()
    kwargs = dict(daemons=[daemon.address], optimizer=trainer.AdamW(lr=LR, weight_decay=0.1),
                  no_weight_decay=_no_decay)  # fmt: skip
    with trainer.offload(
        model, config=trainer.OffloadConfig(model_name="bf16", shard_bytes=4096),
        compression=trainer.CompressionConfig(method="bf16"), **kwargs,
    ) as opt:  # fmt: skip
        _train_offloaded(model, batches, opt)
        assert not opt.io.compressor.error.any()
        assert opt.bytes_pushed == STEPS * 2 * opt.flat.numel
        _assert_same(model, reference, opt, masters)

    model, batches = _case(torch.bfloat16)
    warmup = 3
    with trainer.offload(
        model, config=trainer.OffloadConfig(model_name="onebit", shard_bytes=4096),
        compression=trainer.CompressionConfig(method="onebit", warmup_steps=warmup), **kwargs,
    ) as opt:  # fmt: skip
        losses = _train_offloaded(model, batches, opt)
        onebit = sum(4 * -(-s.numel // 1024) + -(-s.numel // 8) for s in opt.plan)
        assert opt.bytes_pushed == warmup * 2 * opt.flat.numel + (STEPS - warmup) * onebit
        assert losses[-1] < losses[0]
