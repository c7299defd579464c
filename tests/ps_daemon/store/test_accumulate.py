"""A step's gradient pushed in parts (GRADIENT_PART, then APPLY), without a network: what a
part or an APPLY may say, the accumulator's order and duplicates, APPLY against a GRADIENT
push of the same gradient (torch.equal on master, optimizer state and version), what replaces
or frees the parts, RAM accounting, and, over NVMe files, eviction, a failed commit and a
restart. tests/integration/test_gradient_parts.py runs the same through real daemons."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, StorageError
from ps_offload.daemon.model.encodings import parse
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
from ps_offload.daemon.rpc import conversions
from ps_offload.daemon.store import tier_admin
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.daemon.tiers.nvme import PAGE, DirectIO, NvmeFiles
from ps_offload.optimizers import SGD, AdamW, GroupSettings
from ps_offload.proto import ps_pb2
from tests.helpers.payloads import encoded_payload

NUMEL = 3072  # 'w' (2000, group 0) and 'b' (1072, group 1): one 12 KiB shard
GROUPS = (
    GroupSettings(lr=0.01, weight_decay=0.1, beta1=0.9, beta2=0.999, eps=1e-8),
    GroupSettings(lr=0.03, weight_decay=0.0, beta1=0.8, beta2=0.99, eps=1e-6),
)


def _grad(seed: int) -> torch.Tensor:
    """Values over several orders of magnitude, below 0.4 (times 2**16 they fit fp16)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(NUMEL, generator=g) - 0.5) * 0.8 * 10.0 ** torch.randint(-4, 1, (NUMEL,), generator=g).float()


def _store(optimizer=None, files: NvmeFiles | None = None) -> ShardStore:
    """Model 'm' at version 1: initial values, then one RAW gradient."""
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=NUMEL * 4, files=files)
    if not store.registry.recover():
        params = (ParamSpec("w", (2000,), group=0), ParamSpec("b", (1072,), group=1))
        store.registry.register(ModelSpec("m", params, optimizer or AdamW(lr=0.1), NUMEL * 4, ("d",)), 0)
        store.push(PushRequest("m", 0, step=0, kind="parameters", data=torch.linspace(-1, 1, NUMEL)))
        store.push(PushRequest("m", 0, step=0, kind="gradient", data=_grad(0)))
    return store


def _data(encoding: str, grad: torch.Tensor):
    """A parsed payload as the wire hands it to the store: fp32 for RAW, else half values."""
    if encoding == "raw":
        return grad.clone()
    staging, nbytes = encoded_payload(encoding, grad)
    return parse(encoding, staging, nbytes, NUMEL, "test")


def _part(store: ShardStore, step: int, part: int, grad: torch.Tensor, encoding: str = "raw"):
    push = PushRequest("m", 0, step=step, kind="gradient_part", part=part, encoding=encoding)
    return store.push(push.with_data(_data(encoding, grad)))


def _apply(store: ShardStore, step: int, parts: int, **settings):
    return store.push(PushRequest("m", 0, step=step, kind="apply", parts=parts, **settings))


def _state(store: ShardStore) -> list:
    shard = tier_admin.load(store, "m", 0)  # resident (read from NVMe if it was not)
    return [shard.version, *(t.clone() for t in (shard.master, *shard.optimizer.state))]


def _assert_same(a: list, b: list) -> None:
    assert a[0] == b[0] and len(a) == len(b), f"versions {a[0]} and {b[0]}"
    for index, (x, y) in enumerate(zip(a[1:], b[1:], strict=True)):
        name = "master" if index == 0 else f"optimizer state {index - 1}"
        assert torch.equal(x, y), f"{name}: max |diff| {(x - y).abs().max().item()}"


# -- what a push says on its own -----------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(kind="gradient", part=1), "part is for GRADIENT_PART pushes only, this is GRADIENT"),
        (
            dict(kind="momentum", part=1, variance_frozen_at=1),
            "part is for GRADIENT_PART pushes only, this is MOMENTUM",
        ),
        (dict(kind="apply", nbytes=0, parts=2, part=1), "part is for GRADIENT_PART pushes only, this is APPLY"),
        (dict(kind="gradient", parts=2), "parts is for APPLY pushes only, this is GRADIENT"),
        (dict(kind="gradient_part", parts=2), "parts is for APPLY pushes only, this is GRADIENT_PART"),
        (dict(kind="gradient_part", encoding="onebit"), "a GRADIENT_PART must be RAW, BF16 or FP16"),
        (dict(kind="gradient_part", encoding="topk"), "got encoding TOPK; compressed encodings are for whole"),
        (dict(kind="gradient_part", lr=0.1), "lr is for the APPLY of a step pushed in parts"),
        (
            dict(kind="gradient_part", groups=GROUPS),
            "groups is for GRADIENT and APPLY pushes only, this is GRADIENT_PART",
        ),
        (dict(kind="gradient_part", grad_multiplier=0.5), "grad_multiplier is for GRADIENT and APPLY pushes only"),
        (dict(kind="gradient_part", part=1, speculate=True), "speculate is for part 0 of a step"),
        (dict(kind="gradient", speculate=True), "speculate is for GRADIENT_PART pushes only, this is GRADIENT"),
        (dict(kind="apply", nbytes=0, parts=1, speculate=True), "speculate is for GRADIENT_PART pushes only"),
        (dict(kind="gradient_part", speculate=True, lr=0.1, groups=GROUPS), "lr must be unset when groups are given"),
        (dict(kind="gradient_part", speculate=True, grad_multiplier=0.0), "grad_multiplier must be finite and > 0"),
        (dict(kind="apply", nbytes=0, parts=0), "APPLY needs parts >= 1"),
        (dict(kind="apply", nbytes=4, parts=1), "APPLY carries no payload (the parts held are its gradient), got 4"),
        (dict(kind="apply", nbytes=None, parts=1, data=torch.ones(4)), "APPLY carries no payload"),
        (dict(kind="apply", nbytes=0, parts=1, lr=0.1, groups=GROUPS), "lr must be unset when groups are given"),
    ],
)
def test_a_part_or_an_apply_that_says_something_wrong_cannot_be_built(fields, message):
    with pytest.raises(InvalidArgument, match="push to shard 3") as info:
        PushRequest("m", 3, **(dict(step=0, nbytes=4) | fields))
    assert message in str(info.value)


def test_what_parts_and_applies_may_carry_is_accepted():
    for encoding in ("raw", "bf16", "fp16"):
        assert PushRequest("m", 0, step=2, kind="gradient_part", part=5, encoding=encoding).part == 5
    apply = PushRequest("m", 0, step=2, kind="apply", nbytes=0, parts=3, groups=GROUPS, grad_multiplier=2.0**-16)
    assert apply.parts == 3 and apply.payload_bytes == 0
    assert PushRequest("m", 0, step=2, kind="apply", parts=1, lr=0.5).lr == 0.5
    ahead = PushRequest("m", 0, step=2, kind="gradient_part", speculate=True, groups=GROUPS, grad_multiplier=0.5)
    assert ahead.speculate and ahead.groups == GROUPS
    assert PushRequest("m", 0, step=2, kind="gradient_part", speculate=True, lr=0.5).lr == 0.5


def test_the_header_fields_reach_the_request():
    header = ps_pb2.PushHeader(model="m", shard_id=1, step=4, kind=ps_pb2.GRADIENT_PART, encoding=ps_pb2.BF16,
                               dtype=ps_pb2.FLOAT32, nbytes=6, part=2)  # fmt: skip
    push = conversions.push_request(header)
    assert (push.kind, push.part, push.parts, push.encoding) == ("gradient_part", 2, 0, "bf16")
    assert not push.speculate
    header.part, header.speculate = 0, True
    assert conversions.push_request(header).speculate
    header = ps_pb2.PushHeader(model="m", shard_id=1, step=4, kind=ps_pb2.APPLY, encoding=ps_pb2.RAW,
                               dtype=ps_pb2.FLOAT32, parts=3, grad_multiplier=0.25)  # fmt: skip
    push = conversions.push_request(header)
    assert (push.kind, push.parts, push.nbytes, push.grad_multiplier) == ("apply", 3, 0, 0.25)
    header.kind = 9
    with pytest.raises(InvalidArgument, match="kind 9 is unknown; send GRADIENT, PARAMETERS, MOMENTUM, GRADIENT_PART"):
        conversions.push_request(header)


# -- before the payload ---------------------------------------------------------------------


def test_a_part_is_checked_against_the_shard_before_its_payload_is_read():
    store = _store()
    announced = PushRequest("m", 0, step=1, kind="gradient_part", encoding="bf16", nbytes=2 * NUMEL)
    assert store.check_push(announced).duplicate is None
    with pytest.raises(InvalidArgument, match="BF16: 3072 2-byte values"):
        store.check_push(PushRequest("m", 0, step=1, kind="gradient_part", encoding="bf16", nbytes=4 * NUMEL))
    with pytest.raises(FailedPrecondition, match="expects part 0"):
        store.check_push(PushRequest("m", 0, step=1, kind="gradient_part", part=1, nbytes=4 * NUMEL))
    _part(store, 1, 0, _grad(1))
    ack = store.check_push(PushRequest("m", 0, step=1, kind="gradient_part", part=0, nbytes=4 * NUMEL)).duplicate
    assert ack is not None and not ack.applied and ack.version == 1  # held: its payload need not be read
    assert store.stats_snapshot().pushes_duplicate == 1
    with pytest.raises(FailedPrecondition, match="names 2 parts, the daemon holds 1 parts of that step"):
        store.check_push(PushRequest("m", 0, step=1, kind="apply", nbytes=0, parts=2))
    assert store.check_push(PushRequest("m", 0, step=1, kind="apply", nbytes=0, parts=1)).duplicate is None
    with pytest.raises(InvalidArgument, match="groups has 1 entries, the model has 2"):
        store.check_push(PushRequest("m", 0, step=1, kind="apply", nbytes=0, parts=1, groups=GROUPS[:1]))


# -- the accumulator --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("encoding", "settings"),
    [
        ("raw", {}),
        ("raw", dict(lr=0.02)),
        ("bf16", dict(groups=GROUPS)),
        ("fp16", dict(groups=GROUPS, grad_multiplier=2.0**-16)),
    ],
)
def test_one_part_and_its_apply_equal_one_gradient_push(encoding, settings):
    parts, whole = _store(), _store()
    for step in (1, 2):
        grad = _grad(step) * (2.0**16 if "grad_multiplier" in settings else 1.0)
        assert _part(parts, step, 0, grad, encoding).applied
        assert parts.registry.shard("m", 0).version == step  # a part is no update
        ack = _apply(parts, step, 1, **settings)
        assert ack.applied and ack.version == step + 1
        whole.push(PushRequest("m", 0, step=step, kind="gradient", encoding=encoding, data=_data(encoding, grad),
                               **settings))  # fmt: skip
        _assert_same(_state(parts), _state(whole))
    assert parts.registry.shard("m", 0).parts.values is None  # freed
    assert parts.stats_snapshot().pushes_applied == whole.stats_snapshot().pushes_applied == 3


@pytest.mark.parametrize("optimizer", [AdamW(lr=0.1), SGD(lr=0.1, momentum=0.9)])
@pytest.mark.parametrize("encoding", ["raw", "bf16"])
def test_parts_are_summed_in_fp32_in_part_order(optimizer, encoding):
    parts, whole = _store(optimizer), _store(optimizer)
    grads = [_grad(10 + k) for k in range(3)]
    sent = [_data(encoding, g) for g in grads]
    widened = [g if encoding == "raw" else s.decompress(torch.empty(NUMEL)) for g, s in zip(grads, sent, strict=True)]
    total = (widened[0] + widened[1]) + widened[2]
    assert not torch.equal(total, widened[0] + (widened[1] + widened[2]))  # the order shows
    for k, g in enumerate(grads):
        assert _part(parts, 1, k, g, encoding).applied
    assert parts.registry.shard("m", 0).parts.held == 3
    assert torch.equal(parts.registry.shard("m", 0).parts.values, total)
    assert _apply(parts, 1, 3).applied
    whole.push(PushRequest("m", 0, step=1, kind="gradient", data=total))
    _assert_same(_state(parts), _state(whole))


def test_a_resent_part_or_apply_changes_nothing():
    store, reference = _store(), _store()
    grads = [_grad(20), _grad(21)]
    _part(store, 1, 0, grads[0])
    before = store.registry.shard("m", 0).parts.values.clone()
    ack = _part(store, 1, 0, _grad(99))  # the same part again (other bytes: they must be ignored)
    assert not ack.applied and ack.version == 1
    assert torch.equal(store.registry.shard("m", 0).parts.values, before)
    _part(store, 1, 1, grads[1])
    assert not _part(store, 1, 1, grads[1]).applied and not _part(store, 1, 0, grads[0]).applied
    assert _apply(store, 1, 2).applied
    after = _state(store)
    ack = _apply(store, 1, 2)
    assert not ack.applied and ack.version == 2
    ack = _part(store, 1, 0, grads[0])  # a part of a step applied already
    assert not ack.applied and ack.version == 2
    _assert_same(_state(store), after)
    assert store.registry.shard("m", 0).parts.values is None
    reference.push(PushRequest("m", 0, step=1, kind="gradient", data=grads[0] + grads[1]))
    _assert_same(_state(store), _state(reference))
    assert store.stats_snapshot().pushes_duplicate == 5


def test_out_of_order_parts_and_wrong_counts_are_refused_and_change_nothing():
    store, reference = _store(), _store()
    with pytest.raises(FailedPrecondition, match="part 1 of step 1 is out of order; the daemon expects part 0"):
        _part(store, 1, 1, _grad(30))
    with pytest.raises(FailedPrecondition, match="holds 0 parts of that step \\(none:"):
        _apply(store, 1, 1)
    _part(store, 1, 0, _grad(30))
    with pytest.raises(FailedPrecondition, match="expects part 1 \\(parts 0..0 are held\\)"):
        _part(store, 1, 2, _grad(31))
    with pytest.raises(FailedPrecondition, match="names 2 parts, the daemon holds 1"):
        _apply(store, 1, 2)
    with pytest.raises(FailedPrecondition, match="push for step 2 to shard 0, which is at version 1"):
        _part(store, 2, 0, _grad(31))
    with pytest.raises(FailedPrecondition, match="push for step 2"):
        _apply(store, 2, 1)
    with pytest.raises(InvalidArgument, match="groups has 1 entries"):
        _apply(store, 1, 1, groups=GROUPS[:1])
    _assert_same(_state(store), _state(reference))
    assert store.registry.shard("m", 0).parts.held == 1
    _part(store, 1, 1, _grad(31))
    _apply(store, 1, 2)
    reference.push(PushRequest("m", 0, step=1, kind="gradient", data=_grad(30) + _grad(31)))
    _assert_same(_state(store), _state(reference))


def test_parts_need_initial_values():
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=NUMEL * 4)
    store.registry.register(ModelSpec("m", (ParamSpec("w", (NUMEL,)),), AdamW(), NUMEL * 4, ("d",)), 0)
    with pytest.raises(FailedPrecondition, match="push its initial parameters before gradients"):
        _part(store, 0, 0, _grad(1))
    assert store.registry.shard("m", 0).parts.values is None


@pytest.mark.parametrize("kind", ["gradient", "momentum"])
def test_an_update_of_the_step_drops_its_parts(kind):
    store, reference = _store(), _store()
    _part(store, 1, 0, _grad(40))
    _part(store, 1, 1, _grad(41))
    extra = dict(variance_frozen_at=1) if kind == "momentum" else {}
    for target in (store, reference):
        assert target.push(PushRequest("m", 0, step=1, kind=kind, data=_grad(42), **extra)).applied
    assert store.registry.shard("m", 0).parts.values is None
    ack = _apply(store, 1, 2)  # the step is applied: the parts' APPLY is a duplicate
    assert not ack.applied and ack.version == 2
    _assert_same(_state(store), _state(reference))
    _part(store, 2, 0, _grad(43))  # the next step starts from nothing
    _apply(store, 2, 1)
    reference.push(PushRequest("m", 0, step=2, kind="gradient", data=_grad(43)))
    _assert_same(_state(store), _state(reference))


def test_a_part_0_over_a_sum_of_another_step_starts_over():
    """Not reachable through pushes (an update drops older sums); a leftover must not be added to."""
    store, reference = _store(), _store()
    parts = store.registry.shard("m", 0).parts
    parts.step, parts.held, parts.values = 0, 2, torch.full((NUMEL,), 7.0)
    with pytest.raises(FailedPrecondition, match="expects part 0"):
        _part(store, 1, 1, _grad(50))
    _part(store, 1, 0, _grad(50))
    assert parts.step == 1 and parts.held == 1 and torch.equal(parts.values, _grad(50))
    _apply(store, 1, 1)
    reference.push(PushRequest("m", 0, step=1, kind="gradient", data=_grad(50)))
    _assert_same(_state(store), _state(reference))


def test_the_sum_counts_in_ram_used_while_held_and_while_kept():
    """A sum counts while its step is pushed, and after its APPLY while it is kept for the next
    step's; an update that applies no parts frees it."""
    store = _store()
    used = store.stats_snapshot().ram_bytes_used
    _part(store, 1, 0, _grad(60))
    assert store.stats_snapshot().ram_bytes_used == used + NUMEL * 4
    _part(store, 1, 1, _grad(61))
    assert store.stats_snapshot().ram_bytes_used == used + NUMEL * 4
    _apply(store, 1, 2)
    assert store.stats_snapshot().ram_bytes_used == used + NUMEL * 4  # kept
    assert store.stats_snapshot().bytes_pushed == 4 * NUMEL * 4  # parameters, a gradient, two parts
    store.push(PushRequest("m", 0, step=2, kind="gradient", data=_grad(62)))
    assert store.stats_snapshot().ram_bytes_used == used


@pytest.mark.parametrize("encoding", ["raw", "bf16"])
def test_the_next_step_writes_its_sum_over_the_kept_one_and_nothing_of_it_remains(encoding):
    """Step 2's part 0 goes into step 1's sum's memory (no fresh pages), over every value: step
    2 equals a GRADIENT push of its own part, bit for bit, though step 1's sum was larger."""
    store, reference = _store(), _store()
    parts = store.registry.shard("m", 0).parts
    _part(store, 1, 0, _grad(70) * 1e3)
    _part(store, 1, 1, _grad(71) * 1e3)
    _apply(store, 1, 2)
    reference.push(PushRequest("m", 0, step=1, kind="gradient", data=_grad(70) * 1e3 + _grad(71) * 1e3))
    kept = parts.kept.data_ptr()
    _part(store, 2, 0, _grad(72), encoding)
    assert parts.values.data_ptr() == kept and parts.kept is None
    _apply(store, 2, 1)
    reference.push(PushRequest("m", 0, step=2, kind="gradient", data=_data(encoding, _grad(72)), encoding=encoding))
    _assert_same(_state(store), _state(reference))


def test_racing_copies_of_one_part_add_it_once():
    store, reference = _store(), _store()
    _part(store, 1, 0, _grad(70))
    results, start = [], threading.Barrier(6)

    def push() -> None:
        start.wait()
        results.append(_part(store, 1, 1, _grad(71)).applied)

    threads = [threading.Thread(target=push) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 5 + [True]
    _apply(store, 1, 2)
    reference.push(PushRequest("m", 0, step=1, kind="gradient", data=_grad(70) + _grad(71)))
    _assert_same(_state(store), _state(reference))


# -- over NVMe files ----------------------------------------------------------------------


def _files(path) -> NvmeFiles:
    return NvmeFiles(path, io=DirectIO(threads=2, block_bytes=PAGE), fsync=False, spare_slots=1)


def test_parts_stay_while_the_shard_is_evicted_and_apply_commits(tmp_path):
    store, reference = _store(files=_files(tmp_path)), _store()
    tier_admin.evict(store, "m", 0)
    _part(store, 1, 0, _grad(80), "bf16")
    _part(store, 1, 1, _grad(81), "bf16")
    assert store.registry.shard("m", 0).tier == "nvme"  # a part needs neither the values nor RAM for them
    tier_admin.evict(store, "m", 0)
    assert _apply(store, 1, 2, groups=GROUPS).applied
    total = _data("bf16", _grad(80)).decompress(torch.empty(NUMEL)) + _data("bf16", _grad(81)).decompress(
        torch.empty(NUMEL)
    )
    reference.push(PushRequest("m", 0, step=1, kind="gradient", data=total, groups=GROUPS))
    _assert_same(_state(store), _state(reference))
    store.close()
    store.files.close()
    recovered = _store(files=_files(tmp_path))  # a restart: the applied step is on disk
    _assert_same(_state(recovered), _state(reference))
    ack = _apply(recovered, 1, 2)
    assert not ack.applied and ack.version == 2
    recovered.close()
    recovered.files.close()


def test_a_failed_commit_keeps_the_parts_for_a_retry(tmp_path, monkeypatch):
    store, reference = _store(files=_files(tmp_path)), _store()
    _part(store, 1, 0, _grad(90))
    before = _state(store)

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(store.files, "commit", failing)
    with pytest.raises(StorageError, match="keeps version 1"):
        _apply(store, 1, 1)
    monkeypatch.undo()
    _assert_same(_state(store), before)
    assert store.registry.shard("m", 0).parts.held == 1
    assert _apply(store, 1, 1).applied
    reference.push(PushRequest("m", 0, step=1, kind="gradient", data=_grad(90)))
    _assert_same(_state(store), _state(reference))
    store.close()
    store.files.close()


def _accumulator_mappings(directory) -> list[int]:
    """The sizes of this process's mappings of files under `directory` (deleted ones included)."""
    sizes = []
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(directory)):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            sizes.append(hi - lo)
    return sizes


def test_with_an_nvme_tier_the_sum_lives_on_it_not_in_ram(tmp_path):
    """The sum is a mapping of an unlinked file under the NVMe directory (the kernel can page
    it out), not RAM: ram_bytes_used does not move, no file is left in the directory, and the
    mapping is kept once the APPLY is committed (for the next step's sum) and gone after an
    update that applies no parts; the step equals a GRADIENT push of the sum."""
    stale = tmp_path / "accumulators" / "7.f32"
    stale.parent.mkdir()
    stale.write_bytes(b"\0" * 64)  # left by a killed daemon: cleared at start
    store, reference = _store(files=_files(tmp_path)), _store()
    directory = tmp_path / "accumulators"
    assert list(directory.iterdir()) == []
    used = store.stats_snapshot().ram_bytes_used
    _part(store, 1, 0, _grad(100))
    _part(store, 1, 1, _grad(101))
    assert sum(_accumulator_mappings(directory)) >= NUMEL * 4
    assert list(directory.iterdir()) == []  # unlinked once mapped
    assert store.stats_snapshot().ram_bytes_used == used
    assert _apply(store, 1, 2).applied
    assert sum(_accumulator_mappings(directory)) >= NUMEL * 4  # kept for step 2's part 0
    reference.push(PushRequest("m", 0, step=1, kind="gradient", data=_grad(100) + _grad(101)))
    _assert_same(_state(store), _state(reference))
    for target in (store, reference):
        assert target.push(PushRequest("m", 0, step=2, kind="gradient", data=_grad(102))).applied
    assert _accumulator_mappings(directory) == []
    store.close()
    store.files.close()


def test_a_disk_without_room_for_the_sum_refuses_part_0_and_changes_nothing(tmp_path, monkeypatch):
    store = _store(files=_files(tmp_path))
    before = _state(store)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("ps_offload.daemon.tiers.accumulator_files.os.posix_fallocate", full)
    with pytest.raises(ResourceExhausted, match="no room for a 12288-byte gradient accumulator in .*accumulators"):
        _part(store, 1, 0, _grad(110))
    monkeypatch.undo()
    assert store.registry.shard("m", 0).parts.held == 0 and list((tmp_path / "accumulators").iterdir()) == []
    _assert_same(_state(store), before)
    store.close()
    store.files.close()
