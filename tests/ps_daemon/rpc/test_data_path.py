"""ps_offload.daemon.rpc.data_path: the one receive path and the one pull path both fronts call."""

from __future__ import annotations

import pytest
import torch

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.errors import InvalidArgument, NotFound
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec
from ps_offload.daemon.rpc import conversions, data_path
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.store.push import PushRequest
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.optimizers import AdamW
from ps_offload.proto import ps_pb2

NUMEL = 1024


def _store() -> ShardStore:
    store = open_store(ram_bytes=1 << 26, default_shard_bytes=NUMEL * 4)
    store.registry.register(ModelSpec("m", (ParamSpec("w", (NUMEL,)),), AdamW(lr=0.1), NUMEL * 4, ("d",)), 0)
    return store


class Payload:
    """A front's read_payload: copies `data` into the view, and remembers the views it filled."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.views: list[int] = []

    def __call__(self, view: memoryview) -> None:
        self.views.append(len(view))
        view[:] = self.data


def _header(step: int, kind: int = ps_pb2.GRADIENT, nbytes: int = NUMEL * 4, model: str = "m") -> ps_pb2.PushHeader:
    return ps_pb2.PushHeader(
        model=model, shard_id=0, step=step, kind=kind, encoding=ps_pb2.RAW, dtype=ps_pb2.FLOAT32, nbytes=nbytes
    )


def test_a_push_reads_its_payload_once_and_a_retry_reads_none():
    store, pool = _store(), StagingPool(max_bytes=1 << 20)
    values = torch.linspace(-1, 1, NUMEL)
    initial = Payload(values.numpy().tobytes())
    answer = data_path.receive_push(store, _header(0, ps_pb2.PARAMETERS), pool, initial)
    assert (answer.applied, answer.version, initial.views) == (True, 0, [NUMEL * 4])
    assert torch.equal(store.registry.shard("m", 0).master, values)

    gradient = Payload(torch.ones(NUMEL).numpy().tobytes())
    assert data_path.receive_push(store, _header(0), pool, gradient).version == 1 and gradient.views == [NUMEL * 4]
    retry = Payload(b"")
    answer = data_path.receive_push(store, _header(0), pool, retry)
    assert (answer.applied, answer.version, retry.views) == (False, 1, [])  # answered, its payload never read
    assert store.stats.pushes_duplicate == 1 and store.stats.pushes_applied == 1


def test_a_bad_header_is_refused_before_its_payload_is_read():
    store, pool, payload = _store(), StagingPool(max_bytes=1 << 20), Payload(b"")
    with pytest.raises(InvalidArgument, match="push to shard 0"):
        data_path.receive_push(store, _header(0, ps_pb2.PARAMETERS, nbytes=12), pool, payload)
    with pytest.raises(NotFound):
        data_path.receive_push(store, _header(0, model="x"), pool, payload)
    assert payload.views == []


def test_a_snapshot_pull_checks_its_dtype_before_its_tensor():
    # The order both fronts answered in before they shared the conversion.
    request = ps_pb2.PullRequest(model="m", shard_id=2, snapshot="s", dtype=ps_pb2.BFLOAT16, tensor=9)
    with pytest.raises(InvalidArgument, match=r"pull of shard 2 from snapshot 's': FLOAT32 only"):
        conversions.pull_request(request)
    with pytest.raises(InvalidArgument, match="tensor 9 is unknown"):
        conversions.pull_request(ps_pb2.PullRequest(model="m", shard_id=2, dtype=ps_pb2.BFLOAT16, tensor=9))
    pull = conversions.pull_request(ps_pb2.PullRequest(model="m", shard_id=2, min_version=3, tensor=ps_pb2.EXP_AVG))
    assert (pull.model, pull.shard_id, pull.min_version, pull.tensor, pull.dtype, pull.snapshot) == (
        "m", 2, 3, "exp_avg", "float32", ""
    )  # fmt: skip


def test_a_checked_pull_carries_its_shard_and_a_snapshot_pull_never_waits():
    store = _store()
    checked = store.check_pull(conversions.pull_request(ps_pb2.PullRequest(model="m", shard_id=0)))
    assert checked.shard is store.registry.shard("m", 0) and checked.must_wait()  # no initial values yet
    snapshot = conversions.pull_request(ps_pb2.PullRequest(model="m", shard_id=0, snapshot="s"))
    assert not store.check_pull(snapshot).must_wait()
    with pytest.raises(NotFound):  # looked up once, when it is checked
        store.check_pull(conversions.pull_request(ps_pb2.PullRequest(model="m", shard_id=99)))


def test_a_checked_push_carries_its_shard_and_is_not_looked_up_again(monkeypatch):
    """ShardStore.push takes the CheckedPush's shard: the registry is not asked a second time."""
    store = _store()
    push = PushRequest("m", 0, step=0, kind="parameters", nbytes=NUMEL * 4)
    checked = store.check_push(push)
    assert checked.shard is store.registry.shard("m", 0) and checked.duplicate is None

    def no_second_lookup(*args):
        raise AssertionError("the shard was looked up again")

    monkeypatch.setattr(store.registry, "shard", no_second_lookup)
    monkeypatch.setattr(store.registry, "located", no_second_lookup)
    result = store.push(checked.with_data(torch.ones(NUMEL)))
    assert result.applied and result.version == 0
