"""PushCompressor: payload layouts per encoding, error feedback per shard, 1-bit Adam's
momentum, and one payload per (shard, step) however often it is asked for (a resent push
must carry the same bytes and must not fold a gradient into the momentum twice)."""

from __future__ import annotations

import pytest
import torch

from ps_offload import kernels, trainer
from ps_offload.daemon.model.encodings import parse
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.io.push_compression import ENCODINGS, PushCompressor

SHARDS = [ShardSlice(0, 0, 0, 3000), ShardSlice(1, 0, 3000, 1500)]
NUMEL = 4500


def _grads(seed=0):
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def _decoded(payload, shard):
    """What the daemon reads from the payload, decompressed to fp32."""
    data = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8)
    staging = torch.zeros((data.numel() + 3) // 4)
    staging.view(torch.uint8)[: data.numel()] = data
    name = {v: k for k, v in ENCODINGS.items()}[payload.encoding]
    parsed = parse("raw" if name == "none" else name, staging, data.numel(), shard.numel, "t")
    return parsed if isinstance(parsed, torch.Tensor) else parsed.decompress(torch.empty(shard.numel))


@pytest.mark.parametrize("compression", ["bf16", "fp16", "onebit", "topk"])
def test_payload_decodes_to_grad_plus_error_minus_the_new_error(compression):
    compressor = PushCompressor(compression, NUMEL, topk_ratio=0.05)
    grads = _grads()
    compressor.error.copy_(_grads(1) * 0.01)  # a residual left by earlier steps
    before = compressor.error.clone()
    for shard in SHARDS:
        payload = compressor.payload(shard, 0, grads)
        assert payload.encoding == ENCODINGS[compression]
        s = slice(shard.offset, shard.end)
        sent = _decoded(payload, shard)
        # error feedback: what was not sent stays in the error buffer, to the fp32 rounding
        torch.testing.assert_close(sent + compressor.error[s], grads[s] + before[s], rtol=0, atol=1e-6)
    if compression == "onebit":  # blocks start at each shard's first element
        assert len(compressor.payload(SHARDS[1], 0, grads).data) == 4 * 2 + 1500 // 8 + 1


def test_one_payload_per_shard_and_step_until_the_next_step():
    compressor = PushCompressor("onebit", NUMEL)
    grads = _grads()
    first = compressor.payload(SHARDS[0], 0, grads)
    error = compressor.error.clone()
    again = compressor.payload(SHARDS[0], 0, grads * 5)  # a resend of step 0: same bytes
    assert again is first and torch.equal(compressor.error, error)
    later = compressor.payload(SHARDS[0], 1, grads)
    assert later is not first and not torch.equal(compressor.error, error)
    assert torch.equal(compressor.error[3000:], torch.zeros(1500))  # shard 1 not compressed yet


def test_warm_up_and_none_send_the_gradient_as_it_is():
    # None: the caller pushes the gradient buffer itself, in the compute dtype (no copy).
    grads = _grads()
    compressor = PushCompressor("onebit", NUMEL, warmup_steps=2)
    for step in (0, 1):
        assert compressor.payload(SHARDS[1], step, grads) is None
    assert not compressor.error.any()
    assert compressor.payload(SHARDS[1], 2, grads).encoding == ps_pb2.ONEBIT
    plain = PushCompressor("none", NUMEL)
    assert plain.error is None and plain.payload(SHARDS[0], 5, grads) is None


def test_half_precision_gradients_are_widened_before_compression():
    """A bf16 gradient is compressed as its exact fp32 widening, with fp32 error feedback."""
    grads = _grads()
    half = grads.bfloat16()
    ours, widened = PushCompressor("onebit", NUMEL), PushCompressor("onebit", NUMEL)
    for shard in SHARDS:
        got, expected = ours.payload(shard, 0, half), widened.payload(shard, 0, half.float())
        assert (got.encoding, bytes(got.data)) == (expected.encoding, bytes(expected.data))
    assert torch.equal(ours.error, widened.error) and ours.error.any()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (lambda: {"compression": trainer.CompressionConfig(method="int8")}, "CompressionConfig.method must be one of"),
        (lambda: {"compression": trainer.CompressionConfig(method="onebit", warmup_steps=-1)}, "warmup_steps"),
        (lambda: {"compression": trainer.CompressionConfig(method="topk", topk_ratio=0.0)}, "topk_ratio"),
        (lambda: {"compression": trainer.CompressionConfig(method="topk", topk_ratio=1.5)}, "topk_ratio"),
        (
            lambda: {"compression": trainer.CompressionConfig(method="onebit")},
            r"1-bit Adam.*needs CompressionConfig.warmup_steps >= 1",
        ),
    ],
)
def test_offload_refuses_bad_options_before_calling_a_daemon(options, message):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=message):
        trainer.offload(model, daemons=["127.0.0.1:1"], optimizer=trainer.AdamW(), **options())


def test_topk_payload_carries_k_then_indices_then_values():
    grads = _grads()
    payload = PushCompressor("topk", NUMEL, topk_ratio=0.01).payload(SHARDS[0], 0, grads)
    raw = torch.frombuffer(bytearray(payload.data), dtype=torch.int32)
    k = kernels.topk_count(3000, 0.01)
    assert raw[0] == k and raw.numel() == 1 + 2 * k
    indices = raw[1 : 1 + k]
    assert torch.equal(raw[1 + k :].view(torch.float32), grads[:3000][indices.long()])


def test_one_bit_adam_tracks_the_momentum_in_warm_up_and_sends_it_compressed_after():
    beta1, warmup = 0.9, 2
    compressor = PushCompressor("onebit", NUMEL, warmup_steps=warmup, adam_beta1=beta1)
    shard = SHARDS[0]
    s = slice(shard.offset, shard.end)
    expected = torch.zeros(NUMEL)
    for step in range(warmup):
        grads = _grads(step)
        assert compressor.payload(shard, step, grads) is None  # warm-up: the gradient as it is
        assert compressor.payload(shard, step, grads * 3) is None  # a resend folds nothing in twice
        expected[s].lerp_(grads[s], 1 - beta1)
        assert torch.equal(compressor.momentum[s], expected[s])
    assert not compressor.error.any()

    grads = _grads(warmup)
    payload = compressor.payload(shard, warmup, grads)
    assert (payload.encoding, payload.kind, payload.variance_frozen_at) == (ps_pb2.ONEBIT, ps_pb2.MOMENTUM, warmup)
    assert len(payload.data) == 4 * 3 + 3000 // 8
    sent = _decoded(payload, shard)
    assert torch.equal(compressor.momentum[s], sent)  # the trainer goes on from what the daemon holds
    # error feedback on the momentum: what was not sent stays in the error buffer
    target = expected[s].lerp(grads[s], 1 - beta1)
    torch.testing.assert_close(sent + compressor.error[s], target, rtol=0, atol=1e-6)
    assert not compressor.momentum[3000:].any()  # shard 1 untouched
    assert compressor.payload(shard, warmup, grads) is payload


def test_onebit_with_sgd_compresses_the_gradient():
    compressor = PushCompressor("onebit", NUMEL)
    assert compressor.momentum is None
    assert compressor.payload(SHARDS[0], 0, _grads()).kind == ps_pb2.GRADIENT
