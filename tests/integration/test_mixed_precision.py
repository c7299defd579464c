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
from tests.helpers import mixed_precision as mixed
from tests.helpers.training import no_decay


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("n_daemons", "shard_bytes", "staging"),
    [(1, 4096, "auto"), (2, 8192, "auto"), (2, 4096, "always")],
    ids=["1-daemon-4k", "2-daemons-8k", "2-daemons-4k-staged"],
)
def test_half_precision_through_daemons_equals_fp32_master_in_process(
    dtype, n_daemons, shard_bytes, staging, daemon_factory
):
    model, batches = mixed.case(dtype)
    reference = copy.deepcopy(model)
    scaling = trainer.LossScaling(growth_interval=3) if dtype == torch.float16 else None
    masters, _, _ = mixed.train_reference(reference, batches, scaler=scaling)

    daemons = daemon_factory.together([()] * n_daemons)
    with trainer.offload(
        model,
        daemons=[d.address for d in daemons],
        optimizer=trainer.AdamW(lr=mixed.LR, weight_decay=0.1),
        no_weight_decay=no_decay,
        config=trainer.OffloadConfig(shard_bytes=shard_bytes),
        device=trainer.DeviceConfig(staging=staging, host_buffers=2),
        loss_scaling=scaling,
    ) as opt:
        assert len(opt.plan) >= 2 * n_daemons  # shards cut through parameters
        assert opt.host_buffer_bytes == (2 * max(s.numel for s in opt.plan) * 2 if staging == "always" else 0)
        # Staged: no more transfers at once than buffers (2 daemons would give 4 I/O threads).
        assert opt.io.workers == (2 if staging == "always" else max(2, 2 * n_daemons))
        losses = mixed.train_offloaded(model, batches, opt)
        assert losses[-1] < losses[0]
        mixed.assert_same(model, reference, opt, masters)


def test_fp16_overflow_skips_the_step_and_backs_off_the_scale(daemon_factory):
    model, batches = mixed.case(torch.float16)
    reference = copy.deepcopy(model)
    scaling = trainer.LossScaling(growth_interval=2)
    masters, scale, skipped = mixed.train_reference(reference, batches, scaler=scaling, overflow_at=3)
    assert skipped == 1

    daemon = daemon_factory()
    with trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=mixed.LR, weight_decay=0.1),
        no_weight_decay=no_decay, config=trainer.OffloadConfig(shard_bytes=4096), loss_scaling=scaling,
    ) as opt:  # fmt: skip
        mixed.train_offloaded(model, batches, opt, overflow_at=3)
        # The skipped step moved no version: STEPS - 1 updates on every shard.
        assert opt.step_count == mixed.STEPS - 1
        assert opt.loss_scaler.skipped_steps == 1 and opt.loss_scaler.scale == scale
        versions = {opt.client.pull(s, min_version=0, out=memoryview(bytearray(s.numel * 4))) for s in opt.plan}
        assert versions == {mixed.STEPS - 1}
        mixed.assert_same(model, reference, opt, masters)


def _bytes_pulled(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10).bytes_pulled


def test_bf16_pulls_move_half_the_bytes_of_fp32_pulls(daemon_factory):
    pulled = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, batches = mixed.case(dtype)
        daemon = daemon_factory()
        with trainer.offload(
            model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=mixed.LR),
            config=trainer.OffloadConfig(shard_bytes=4096),
        ) as opt:  # fmt: skip
            before = _bytes_pulled(daemon.address)
            mixed.train_offloaded(model, batches[:3], opt)
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
    model, batches = mixed.case(torch.bfloat16)
    reference = copy.deepcopy(model)
    masters, _, _ = mixed.train_reference(reference, batches)
    daemon = daemon_factory()
    kwargs = dict(daemons=[daemon.address], optimizer=trainer.AdamW(lr=mixed.LR, weight_decay=0.1),
                  no_weight_decay=no_decay)  # fmt: skip
    with trainer.offload(
        model, config=trainer.OffloadConfig(model_name="bf16", shard_bytes=4096),
        compression=trainer.CompressionConfig(method="bf16"), **kwargs,
    ) as opt:  # fmt: skip
        mixed.train_offloaded(model, batches, opt)
        assert not opt.io.compressor.error.any()
        assert opt.bytes_pushed == mixed.STEPS * 2 * opt.flat.numel
        mixed.assert_same(model, reference, opt, masters)

    model, batches = mixed.case(torch.bfloat16)
    warmup = 3
    with trainer.offload(
        model, config=trainer.OffloadConfig(model_name="onebit", shard_bytes=4096),
        compression=trainer.CompressionConfig(method="onebit", warmup_steps=warmup), **kwargs,
    ) as opt:  # fmt: skip
        losses = mixed.train_offloaded(model, batches, opt)
        onebit = sum(4 * -(-s.numel // 1024) + -(-s.numel // 8) for s in opt.plan)
        assert opt.bytes_pushed == warmup * 2 * opt.flat.numel + (mixed.STEPS - warmup) * onebit
        assert losses[-1] < losses[0]
