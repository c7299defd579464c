"""Compressed pushes through ShardStore (no network): what each encoding applies, 1-bit Adam's
MOMENTUM pushes, and that the step rules are the RAW ones (version bump, a repeated
(shard, step) applies nothing, a future step is refused)."""

from __future__ import annotations

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.errors import FailedPrecondition, InvalidArgument
from ps_offload.daemon.model.encodings import check_size, parse
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
from ps_offload.daemon.store.push import PushRequest
from ps_offload.optimizers import SGD, AdamW
from ps_offload.proto.payloads import onebit_nbytes
from tests.helpers.payloads import encoded_payload

# Two parameters with different weight decay in one 12 KiB shard (3072 elements), and a
# second, partial shard of 928: blocks start at each shard's first element.
PARAMS = (ParamSpec("w", (40, 50), weight_decay=0.1), ParamSpec("b", (2000,), weight_decay=0.0))
SHARD_BYTES = 12288
NUMELS = (3072, 928)


def _store(optimizer, name="m"):
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=SHARD_BYTES)
    store.registry.register(ModelSpec(name, PARAMS, optimizer, SHARD_BYTES, ("d",)), 0)
    torch.manual_seed(0)
    initial = torch.randn(sum(NUMELS))
    for shard_id, (start, n) in enumerate(zip((0, NUMELS[0]), NUMELS, strict=True)):
        store.push(
            PushRequest(name, shard_id, step=0, kind="parameters", data=initial[start : start + n].clone(), lr=None)
        )
    return store


def _grad(n, step):
    return torch.randn(n, generator=torch.Generator().manual_seed(10 * step + n)) * (1 + step)


def _apply(store, encoding, shard_id, step, grad, name="m", kind="gradient", variance_frozen_at=None):
    staging, nbytes = encoded_payload(encoding, grad)
    n = NUMELS[shard_id]
    check_size(encoding, nbytes, n, "test")
    frozen = dict(variance_frozen_at=variance_frozen_at)
    header = PushRequest(name, shard_id, step=step, kind=kind, nbytes=nbytes, encoding=encoding, **frozen)
    assert store.check_push(header).duplicate is None
    data = parse(encoding, staging, nbytes, n, "t")
    return store.push(PushRequest(name, shard_id, step=step, kind=kind, data=data, lr=0.01, **frozen))


def _state(store, name="m"):
    shards = store.registry.model(name).shards.values()
    return [t.clone() for s in shards for t in (s.master, *s.optimizer.state)]


@pytest.mark.parametrize("encoding", ["bf16", "fp16", "topk", "onebit", "onebit-sgd"])
def test_compressed_gradients_apply_exactly_what_raw_would(encoding):
    """A compressed GRADIENT is decompressed to fp32 and goes through the RAW path, so it
    must equal a RAW push of the decompressed gradient bit for bit."""
    optimizer = SGD(lr=0.01, momentum=0.9) if encoding == "onebit-sgd" else AdamW(weight_decay=0.1)
    encoding = encoding.removesuffix("-sgd")
    ours, raw = _store(optimizer), _store(optimizer)
    for step in range(3):
        for shard_id, n in enumerate(NUMELS):
            grad = _grad(n, step)
            staging, nbytes = encoded_payload(encoding, grad)
            decompressed = parse(encoding, staging, nbytes, n, "t").decompress(torch.empty(n))
            assert _apply(ours, encoding, shard_id, step, grad).applied
            raw.push(PushRequest("m", shard_id, step=step, kind="gradient", data=decompressed, lr=0.01))
    for a, b in zip(_state(ours), _state(raw), strict=True):
        assert torch.equal(a, b)


def _warm_up(store, steps):
    for step in range(steps):
        for shard_id, n in enumerate(NUMELS):
            store.push(PushRequest("m", shard_id, step=step, kind="gradient", data=_grad(n, step), lr=0.01))


def test_onebit_momentum_is_fused_and_matches_the_decompressed_momentum():
    """After 3 plain steps, 1-bit Adam: exp_avg becomes the pushed momentum, exp_avg_sq stays
    as the warm-up left it, and the master moves as a RAW momentum push of the decompressed
    values moves it (the fused kernel against plain torch; tests/kernels/test_fused_adamw.py)."""
    ours, raw = _store(AdamW(weight_decay=0.1)), _store(AdamW(weight_decay=0.1))
    _warm_up(ours, 3)
    _warm_up(raw, 3)
    frozen = [s.optimizer.state[1].clone() for s in ours.registry.model("m").shards.values()]
    for step in range(3, 6):
        for shard_id, n in enumerate(NUMELS):
            momentum = _grad(n, step) * 1e-2
            staging, nbytes = encoded_payload("onebit", momentum)
            payload = parse("onebit", staging, nbytes, n, "t")
            result = _apply(ours, "onebit", shard_id, step, momentum, kind="momentum", variance_frozen_at=3)
            assert result.applied and result.version == step + 1
            decompressed = payload.decompress(torch.empty(n))
            raw.push(
                PushRequest("m", shard_id, step=step, kind="momentum", data=decompressed, lr=0.01, variance_frozen_at=3)
            )
            m = ours.registry.shard("m", shard_id).optimizer.state[0]
            assert torch.equal(m, decompressed)
    for shard, v in zip(ours.registry.model("m").shards.values(), frozen, strict=True):
        assert torch.equal(shard.optimizer.state[1], v)
    for a, b in zip(_state(ours), _state(raw), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(_state(ours)[0], _state(_store(AdamW()))[0])
    onebit_steps, raw_steps = 3, 3
    expected = raw_steps * 4 * sum(NUMELS) + onebit_steps * sum(onebit_nbytes(n) for n in NUMELS) + 4 * sum(NUMELS)
    assert ours.stats_snapshot().bytes_pushed == expected  # parameters, 3 raw steps, 3 compressed


@pytest.mark.parametrize(
    ("frozen", "step", "message"),
    [(None, 2, r"needs variance_frozen_at in \[1, 2\].*got None"), (0, 2, "got 0"), (3, 2, r"in \[1, 2\].*got 3")],
)
def test_momentum_pushes_need_a_variance_frozen_within_the_steps_taken(frozen, step, message):
    store = _store(AdamW())
    _warm_up(store, step)
    with pytest.raises(InvalidArgument, match=message):
        store.check_push(PushRequest("m", 0, step=step, kind="momentum", nbytes=onebit_nbytes(3072),
                                     encoding="onebit", variance_frozen_at=frozen))  # fmt: skip
    before = _state(store)
    with pytest.raises(InvalidArgument, match=message):
        store.push(
            PushRequest("m", 0, step=step, kind="momentum", data=torch.zeros(3072), lr=0.01, variance_frozen_at=frozen)
        )
    assert all(torch.equal(a, b) for a, b in zip(before, _state(store), strict=True))


def test_momentum_pushes_are_refused_for_sgd_and_the_frozen_step_for_gradients():
    store = _store(SGD(lr=0.1, momentum=0.9))
    _warm_up(store, 1)
    with pytest.raises(FailedPrecondition, match="need an AdamW model; model 'm' runs sgd"):
        store.check_push(
            PushRequest("m", 0, step=1, kind="momentum", nbytes=4 * 3072, dtype="float32", variance_frozen_at=1)
        )
    with pytest.raises(InvalidArgument, match="variance_frozen_at is for MOMENTUM pushes only, this is GRADIENT"):
        store.check_push(
            PushRequest("m", 0, step=1, kind="gradient", nbytes=4 * 3072, dtype="float32", variance_frozen_at=1)
        )


def test_compressed_retry_of_an_applied_step_changes_nothing():
    store = _store(AdamW())
    assert _apply(store, "onebit", 0, 0, _grad(3072, 0)).version == 1
    before = _state(store)
    staging, nbytes = encoded_payload("onebit", _grad(3072, 7))  # a retry carrying other bytes
    ack = store.check_push(
        PushRequest("m", 0, step=0, kind="gradient", nbytes=nbytes, dtype="float32", encoding="onebit")
    ).duplicate
    assert ack is not None and not ack.applied and ack.version == 1  # answered before the payload
    late = store.push(
        PushRequest("m", 0, step=0, kind="gradient", data=parse("onebit", staging, nbytes, 3072, "t"), lr=0.01)
    )
    assert not late.applied and late.version == 1  # a retry that raced past the header check
    assert all(torch.equal(a, b) for a, b in zip(before, _state(store), strict=True))
    with pytest.raises(FailedPrecondition, match="step 5"):
        store.check_push(
            PushRequest("m", 0, step=5, kind="gradient", nbytes=nbytes, dtype="float32", encoding="onebit")
        )


@pytest.mark.parametrize(
    ("encoding", "nbytes", "message"),
    [
        ("onebit", 400, "3 float32 scales + 384 sign bytes = 396 bytes"),
        ("bf16", 6142, "BF16: 3072 2-byte values = 6144 bytes"),
        ("fp16", 12288, "FP16: 3072 2-byte values"),
        ("topk", 8, "4 + 8 K bytes"),
        ("topk", 4 + 8 * 3073, "1 <= K <= 3072"),
        ("topk", 15, "4 + 8 K bytes"),
        ("zstd", 100, "unknown encoding 'zstd'"),
    ],
)
def test_wrong_sizes_are_refused_naming_the_shard_and_what_it_needs(encoding, nbytes, message):
    store = _store(AdamW())
    with pytest.raises(InvalidArgument, match="push to shard 0") as info:
        store.check_push(
            PushRequest("m", 0, step=0, kind="gradient", nbytes=nbytes, dtype="float32", encoding=encoding)
        )
    assert message in str(info.value)


def test_compressed_parameters_are_refused():
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=SHARD_BYTES)
    store.registry.register(ModelSpec("m", PARAMS, AdamW(), SHARD_BYTES, ("d",)), 0)
    with pytest.raises(InvalidArgument, match="PARAMETERS must be RAW float32.*ONEBIT"):
        store.check_push(PushRequest("m", 0, step=0, kind="parameters", nbytes=onebit_nbytes(3072), encoding="onebit"))


def _topk_staging(k_said, indices, values):
    raw = torch.cat([torch.tensor([k_said], dtype=torch.int32).view(torch.uint8),
                     torch.tensor(indices, dtype=torch.int32).view(torch.uint8),
                     torch.tensor(values, dtype=torch.float32).view(torch.uint8)])  # fmt: skip
    return raw.view(torch.float32).clone(), raw.numel()


@pytest.mark.parametrize(
    ("k_said", "indices", "message"),
    [
        (3, [1, 2], "says K = 3, but its 20 bytes hold K = 2"),
        (2, [5, 3072], r"index 3072 \(position 1\) is outside the shard\'s 3072 elements"),
        (2, [-1, 4], r"index -1 \(position 0\) is outside"),
        (3, [5, 9, 9], "strictly ascending.*index 9 at position 2 follows 9"),
        (3, [1030, 7, 2000], "index 7 at position 1 follows 1030"),
    ],
)
def test_bad_topk_content_is_refused(k_said, indices, message):
    staging, nbytes = _topk_staging(k_said, indices, [1.0] * len(indices))
    with pytest.raises(InvalidArgument, match=message):
        parse("topk", staging, nbytes, 3072, "push to shard 0")
