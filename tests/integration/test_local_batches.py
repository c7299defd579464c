"""A DataBatch on the local transport against a real daemon: a block's pulls and pushes in one
frame are applied and answered as the same requests one by one, each request is answered on
its own (one refused, the others served), a batch that is not well formed is refused whole
with nothing served, the token is the frame's, and a trainer sends batches only where they
can go (unreplicated shards, bytes in the daemon's windows) and falls back to one request per
shard when a batch fails."""

from __future__ import annotations

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.daemon.dataplane.requests import MAX_BATCH_REQUESTS
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import recv_message, send_message
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.io.device import byte_view
from ps_offload.trainer.wire.dataplane_client import DataPlaneError
from ps_offload.trainer.wire.local_client import LocalClient
from ps_offload.trainer.wire.sharded_client import ShardedClient
from tests.helpers.specs import local_spec

NUMEL = 1024  # a shard's elements (local_spec: 3 shards)


def _client(address: str, model: str, **config) -> ShardedClient:
    """The model registered over the local transport, every shard at 1.0 (version 0)."""
    client = ShardedClient([address], config=trainer.ClientConfig(**({"transport": "local"} | config)))
    client.register(local_spec(model))
    for shard in client.plan:
        client.push(shard, Push.parameters(model, shard.shard_id, byte_view(torch.ones(shard.numel)), step=0))
    return client


def _local(client: ShardedClient) -> LocalClient:
    local = client.transports[0]
    assert type(local) is LocalClient
    return local


def _values(client: ShardedClient) -> list[bytes]:
    """Every shard's master values, pulled one request each."""
    out = []
    for shard in client.plan:
        values = torch.empty(shard.numel)
        client.pull(shard, min_version=0, out=byte_view(values))
        out.append(byte_view(values).tobytes())
    return out


def _gradients(client: ShardedClient) -> torch.Tensor:
    """A window holding a distinct gradient for each shard, one after another."""
    window = client.transports.shared_host_tensor(3 * NUMEL, torch.float32)
    assert window is not None
    window.copy_(torch.linspace(-3, 3, 3 * NUMEL))
    return window


def _views(tensor: torch.Tensor) -> list[memoryview]:
    return [byte_view(tensor[i * NUMEL : (i + 1) * NUMEL]) for i in range(3)]


def _pushes(client: ShardedClient, grads: torch.Tensor) -> list[Push]:
    """A step-0 GRADIENT push of each shard, from its piece of `grads`."""
    return [
        Push.gradient(client.model, s.shard_id, view, step=0)
        for s, view in zip(client.plan, _views(grads), strict=True)
    ]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    daemon = LocalDaemon(tmp_path_factory.mktemp("batches"))
    try:
        yield daemon
    finally:
        daemon.kill()


def test_a_batch_applies_and_answers_as_the_requests_one_by_one(daemon):
    batched, alone = _client(daemon.address, "batched"), _client(daemon.address, "alone")
    grads = _gradients(batched)
    assert batched.batch_groups(batched.plan, _views(grads)) == [[0, 1, 2]]  # one daemon's shards: one run
    answers = batched.push_batch(batched.plan, _pushes(batched, grads))
    assert [a.applied for a in answers] == [True] * 3
    for shard, view in zip(alone.plan, _views(grads.clone()), strict=True):
        assert alone.push(shard, Push.gradient("alone", shard.shard_id, view, step=0)).applied
    assert _local(batched).batches_sent == 1
    assert _values(batched) == _values(alone)  # bit for bit

    window = batched.transports.shared_host_tensor(3 * NUMEL, torch.float32)
    window.fill_(float("nan"))
    copied = _local(batched).bytes_copied
    assert batched.pull_batch(batched.plan, _views(window), min_version=1) == [1, 1, 1]
    assert _local(batched).batches_sent == 2
    assert _local(batched).bytes_copied == copied  # written where they lie
    assert [byte_view(window[i * NUMEL : (i + 1) * NUMEL]).tobytes() for i in range(3)] == _values(alone)
    # A push applied before is answered as alone: taken once, not applied again.
    again = batched.push_batch(batched.plan, _pushes(batched, grads))
    assert [a.applied for a in again] == [False] * 3
    assert _values(batched) == _values(alone)
    batched.close()
    alone.close()


def test_each_request_of_a_batch_is_answered_on_its_own(daemon):
    client = _client(daemon.address, "each-alone")
    grads = _gradients(client)
    views = _views(grads)
    pushes = [
        Push.gradient("each-alone", 0, views[0], step=5),  # a step ahead of the shard's: refused
        Push.gradient("each-alone", 1, views[1], step=0),
        Push.gradient("each-alone", 2, views[2], step=0),
    ]
    answers = _local(client).push_batch(pushes, timeout=30)
    assert isinstance(answers[0], DataPlaneError) and answers[0].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert answers[1].applied and answers[2].applied
    versions = [client.pull(s, min_version=0, out=byte_view(torch.empty(NUMEL))) for s in client.plan]
    assert versions == [0, 1, 1]  # the refused one changed nothing, the others were applied
    client.close()


def _bad_batch(client: ShardedClient, grads: torch.Tensor, case: str) -> ps_pb2.DataRequest:
    local = _local(client)
    push = ps_pb2.DataRequest(
        push=Push.gradient(client.model, 0, _views(grads)[0], step=0).header, local=local._ref(_views(grads)[0])
    )
    pull = ps_pb2.DataRequest(pull=Pull.of(client.model, 1, min_version=0).request)
    requests = {
        "empty": [],
        "too many": [push] + [pull] * MAX_BATCH_REQUESTS,
        "an attach": [push, ps_pb2.DataRequest(attach=ps_pb2.LocalAttach(window=7))],
        "a batch": [push, ps_pb2.DataRequest(batch=ps_pb2.DataBatch(requests=[pull]))],
        "an empty request": [push, ps_pb2.DataRequest()],
    }[case]
    return ps_pb2.DataRequest(batch=ps_pb2.DataBatch(requests=requests))


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", "holds 1 to 256 requests; this one holds 0"),
        ("too many", f"holds 1 to 256 requests; this one holds {MAX_BATCH_REQUESTS + 1}"),
        ("an attach", "pulls and pushes only; its request 1 is attach"),
        ("a batch", "pulls and pushes only; its request 1 is batch"),
        ("an empty request", "pulls and pushes only; its request 1 is empty"),
    ],
)
def test_a_batch_not_well_formed_is_refused_whole_and_serves_nothing(daemon, case, message):
    model = f"bad-batch-{case.replace(' ', '-')}"
    client = _client(daemon.address, model)
    grads = _gradients(client)
    before = _values(client)
    with _local(client)._connection(30, fence=False) as conn:
        send_message(conn.sock, _bad_batch(client, grads, case))
        answer = recv_message(conn.sock, ps_pb2.DataResponse)
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in answer.message, answer.message
    assert not answer.batch.answers
    assert _values(client) == before  # its push was not applied
    assert client.push_batch(client.plan, _pushes(client, grads))[0].applied  # the connection still serves
    client.close()


def test_the_token_of_a_batch_is_the_frames(daemon_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("batch-token-0123456789\n")
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\ntoken_file = "{token}"\nrequire_token = "all"\n')
    daemon = daemon_factory(config=config)
    client = _client(daemon.address, "batch-tokens", security=ClientSecurity(token_file=str(token)))
    out = client.transports.shared_host_tensor(3 * NUMEL, torch.float32)
    assert client.pull_batch(client.plan, _views(out), min_version=0) == [0, 0, 0]
    assert _local(client).batches_sent == 1
    pulls = [ps_pb2.DataRequest(pull=Pull.of("batch-tokens", s.shard_id, min_version=0).request) for s in client.plan]
    for request, view in zip(pulls, _views(out), strict=True):
        request.local.CopyFrom(_local(client)._ref(view))
        request.authorization = "Bearer batch-token-0123456789"  # a request's own: ignored
    with _local(client)._connection(30, fence=False) as conn:
        send_message(conn.sock, ps_pb2.DataRequest(batch=ps_pb2.DataBatch(requests=pulls)))
        answer = recv_message(conn.sock, ps_pb2.DataResponse)
    assert [a.code for a in answer.batch.answers] == [grpc.StatusCode.UNAUTHENTICATED.value[0]] * 3
    client.close()


def test_batches_go_only_where_they_can_and_a_failed_one_falls_back_to_single_requests(daemon, monkeypatch):
    client = _client(daemon.address, "where-batches-go")
    grads = _gradients(client)
    private = torch.zeros(3 * NUMEL)
    # Bytes outside the daemon's windows, or a daemon that takes no batches: one request each.
    assert client.batch_groups(client.plan, _views(private)) == [[0], [1], [2]]
    assert client.batch_groups(client.plan, [*_views(grads)[:2], _views(private)[2]]) == [[0, 1], [2]]
    _local(client).takes_batches = False
    assert client.batch_groups(client.plan) == [[0], [1], [2]]
    _local(client).takes_batches = True
    grpc_client = ShardedClient([daemon.address], config=trainer.ClientConfig(transport="grpc"))
    grpc_client.register(local_spec("where-batches-go"))
    assert grpc_client.batch_groups(grpc_client.plan) == [[0], [1], [2]]
    grpc_client.close()

    def broken(requests, timeout):
        raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, "the batch was lost")

    monkeypatch.setattr(_local(client), "_batch", broken)
    answers = client.push_batch(client.plan, _pushes(client, grads))
    assert [a.applied for a in answers] == [True] * 3  # each sent on its own instead
    out = client.transports.shared_host_tensor(3 * NUMEL, torch.float32)
    assert client.pull_batch(client.plan, _views(out), min_version=1) == [1, 1, 1]
    assert [byte_view(out[i * NUMEL : (i + 1) * NUMEL]).tobytes() for i in range(3)] == _values(client)
    client.close()
