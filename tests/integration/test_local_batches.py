"""The local transport's batches (proto DataBatch) against real daemons: a daemon's pulls or
pushes in one round trip give what the same requests give one at a time, bit for bit; an error
in one request fails only that one (ShardedClient sends it again alone, with its retries); a
batch that fails as a whole is sent again shard by shard; a batch's pulls share its deadline;
the token is checked on each of its requests; and bad batches are refused with a reason."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.admin.client import stats
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import recv_message, send_message
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.io.device import byte_view
from ps_offload.trainer.wire.daemon_client import DaemonError
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient, DataPlaneError
from ps_offload.trainer.wire.local_client import LocalClient
from ps_offload.trainer.wire.sharded_client import ShardedClient
from tests.helpers.specs import local_spec

NUMEL = 1024  # local_spec's shards: 3 of NUMEL fp32


@pytest.fixture(scope="module", params=["ram", "nvme"])
def daemon(request, tmp_path_factory):
    """RAM only a batch is served in order; with NVMe its runs of pushes side by side
    (ps_offload.daemon.dataplane.batch_runs): each test holds for both."""
    from ps_offload.daemon.local import LocalDaemon

    directory = tmp_path_factory.mktemp("batches")
    nvme = ["--nvme-dir", str(directory / "nvme")] if request.param == "nvme" else []
    daemon = LocalDaemon(directory / "daemon", *nvme)
    try:
        yield daemon
    finally:
        daemon.kill()


def _client(address: str, model: str, *, transport: str = "local", **config) -> ShardedClient:
    """The model of 3 shards, shard i set to i + 1 (version 0)."""
    client = ShardedClient([address], config=trainer.ClientConfig(transport=transport, **config))
    for shard in client.register(local_spec(model)):
        values = torch.full((shard.numel,), float(shard.shard_id + 1))
        client.push(shard, Push.parameters(model, shard.shard_id, byte_view(values)))
    return client


def _local(client: ShardedClient) -> LocalClient:
    local = client.transports[0]
    assert type(local) is LocalClient
    return local


def _window(client: ShardedClient) -> list[torch.Tensor]:
    """One tensor of the model's size in a window the daemon has, cut per shard."""
    window = client.transports.shared_host_tensor(3 * NUMEL, torch.float32)
    assert window is not None
    return [window[s.offset : s.end] for s in client.plan]


def _state(address: str, model: str) -> list[bytes]:
    client = ShardedClient([address], config=trainer.ClientConfig(transport="grpc"))
    client.register(local_spec(model))
    out = []
    for shard in client.plan:
        values = torch.empty(shard.numel)
        client.pull(shard, min_version=0, out=byte_view(values))
        out.append(byte_view(values).tobytes())
    client.close()
    return out


def _not_alone(monkeypatch) -> None:
    """Any request sent alone fails the test: the batch must carry them all."""

    def alone(*args, **kwargs):
        raise AssertionError("a request was sent alone")

    monkeypatch.setattr(LocalClient, "pull_into", alone)
    monkeypatch.setattr(LocalClient, "push", alone)


def test_a_batch_of_pulls_writes_what_pulls_one_by_one_write(daemon, monkeypatch):
    client = _client(daemon.address, "batch-pulls")
    outs = _window(client)
    _not_alone(monkeypatch)
    copied = _local(client).bytes_copied
    assert client.batches(client.plan) == [[0, 1, 2]]
    assert client.pull_batch(client.plan, [byte_view(o) for o in outs], min_version=0) == [0, 0, 0]
    assert _local(client).bytes_copied == copied  # written in place by the daemon
    assert [byte_view(o).tobytes() for o in outs] == _state(daemon.address, "batch-pulls")
    assert [o[0].item() for o in outs] == [1.0, 2.0, 3.0]
    client.close()


def test_a_batch_of_pushes_steps_each_shard_as_pushes_one_by_one_do(daemon, monkeypatch):
    grads = [torch.linspace(-1, 1, NUMEL) * (i + 1) for i in range(3)]
    alone = _client(daemon.address, "pushes-alone")
    for shard, grad in zip(alone.plan, grads, strict=True):
        assert alone.push(shard, Push.gradient(alone.model, shard.shard_id, byte_view(grad), step=0)).applied
    alone.close()
    client = _client(daemon.address, "pushes-batched")
    places = _window(client)
    for place, grad in zip(places, grads, strict=True):
        place.copy_(grad)
    pushes = [
        Push.gradient(client.model, s.shard_id, byte_view(p), step=0) for s, p in zip(client.plan, places, strict=True)
    ]
    with monkeypatch.context() as patch:
        _not_alone(patch)
        acks = client.push_batch(client.plan, pushes)
        assert [(a.applied, a.version) for a in acks] == [(True, 1)] * 3
        again = client.push_batch(client.plan, pushes)  # the same (shard, step): answered, not applied
        assert [(a.applied, a.version) for a in again] == [(False, 1)] * 3
    assert _state(daemon.address, "pushes-batched") == _state(daemon.address, "pushes-alone")
    client.close()


def test_a_shard_pushed_twice_in_a_batch_is_stepped_in_the_batchs_order(daemon):
    """Pushes 0, 1, 2 of step 0, then 0 and 1 of step 1: with NVMe the first three are served
    side by side and the last two after them (a shard already in the run ends it), so the state
    is what pushing them one by one, in order, makes; with NVMe each is committed."""
    grads = [torch.linspace(-1, 1, NUMEL) * (i + 1) for i in range(5)]
    order = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]  # (shard, step)
    alone = _client(daemon.address, "twice-alone")
    for (shard, step), grad in zip(order, grads, strict=True):
        assert alone.push(alone.plan[shard], Push.gradient(alone.model, shard, byte_view(grad), step=step)).applied
    alone.close()
    client = _client(daemon.address, "twice-batched")
    places = _window(client) + _window(client)[:2]
    for place, grad in zip(places, grads, strict=True):
        place.copy_(grad)
    committed = stats(daemon.address, 30).nvme_commits
    pushes = [
        Push.gradient(client.model, shard, byte_view(place), step=step)
        for (shard, step), place in zip(order, places, strict=True)
    ]
    acks = _local(client).push_batch(pushes, timeout=30)
    assert [(a.applied, a.version) for a in acks] == [(True, 1)] * 3 + [(True, 2)] * 2
    assert _state(daemon.address, "twice-batched") == _state(daemon.address, "twice-alone")
    assert stats(daemon.address, 30).nvme_commits - committed == (5 if "--nvme-dir" in daemon.process.args else 0)
    client.close()


def test_an_empty_batch_from_the_client_is_answered_with_nothing_and_the_connection_serves_on(daemon):
    # The client adds a batch's requests in place: with none added, what it sends must still be
    # a batch (not a request carrying nothing, which the daemon refuses).
    client = _client(daemon.address, "batch-empty-client")
    local = _local(client)
    assert local.push_batch([], timeout=30) == []
    assert local.pull_batch([], timeout=30) == []
    outs = _window(client)
    assert client.pull_batch(client.plan, [byte_view(o) for o in outs], min_version=0) == [0, 0, 0]
    client.close()


def test_an_error_in_a_batch_fails_only_its_own_request(daemon):
    client = _client(daemon.address, "batch-error")
    local = _local(client)
    places = _window(client)
    for place in places:
        place.fill_(0.5)
    before = _state(daemon.address, "batch-error")
    good = [
        Push.gradient(client.model, s.shard_id, byte_view(p), step=0) for s, p in zip(client.plan, places, strict=True)
    ]
    # Shard 1's push carries 8 of its 1024 elements: the daemon refuses it, and only it.
    wrong = Push.gradient(client.model, 1, byte_view(places[1][:8]), step=0)
    answers = local.push_batch([good[0], wrong, good[2]], timeout=30)
    assert isinstance(answers[0], ps_pb2.PushResponse) and answers[0].applied
    assert isinstance(answers[1], DataPlaneError) and answers[1].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(answers[2], ps_pb2.PushResponse) and answers[2].applied
    after = _state(daemon.address, "batch-error")
    assert after[1] == before[1] and after[0] != before[0] and after[2] != before[2]
    # Through ShardedClient, the refused push is sent again alone and its error is the shard's.
    bad = Push.gradient(client.model, 1, byte_view(places[1][:8]), step=1)
    results = client.push_batch(
        client.plan, [Push.gradient(client.model, 0, byte_view(places[0]), step=1), bad,
                      Push.gradient(client.model, 2, byte_view(places[2]), step=1)],
    )  # fmt: skip
    assert isinstance(results[1], DaemonError) and results[1].code == grpc.StatusCode.INVALID_ARGUMENT
    assert [r.version for i, r in enumerate(results) if i != 1] == [2, 2]
    client.close()


def test_a_batch_that_fails_as_a_whole_is_sent_again_shard_by_shard(daemon, monkeypatch):
    client = _client(daemon.address, "batch-broken")
    outs = _window(client)
    failed = []

    def broken(self, conn, batch):
        failed.append(len(batch.batch.requests))
        raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, "the connection broke (injected)")

    monkeypatch.setattr(LocalClient, "_batch", broken)
    assert client.pull_batch(client.plan, [byte_view(o) for o in outs], min_version=0) == [0, 0, 0]
    assert failed == [3]
    assert [o[0].item() for o in outs] == [1.0, 2.0, 3.0]
    client.close()


def test_a_batch_of_pulls_shares_one_deadline(daemon):
    """Three pulls of a version that never comes, in a batch of 2 s: each answers
    DEADLINE_EXCEEDED, and the batch ends after about 2 s, not 3 x 2."""
    client = _client(daemon.address, "batch-deadline")
    local = _local(client)
    outs = _window(client)
    pulls = [
        (Pull.of(client.model, s.shard_id, min_version=5), byte_view(o)) for s, o in zip(client.plan, outs, strict=True)
    ]
    started = time.monotonic()
    answers = local.pull_batch(pulls, timeout=2.0)
    elapsed = time.monotonic() - started
    assert [a.code() for a in answers] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 3, answers
    assert elapsed < 5.0, f"the batch took {elapsed:.1f} s: its pulls did not share its deadline"
    client.close()


def test_the_token_is_checked_on_each_request_of_a_batch(daemon_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("batch-token-0123456789\n")
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\ntoken_file = "{token}"\nrequire_token = "all"\n')
    daemon = daemon_factory(config=config)
    client = _client(daemon.address, "batch-tokens", security=ClientSecurity(token_file=str(token)))
    outs = _window(client)
    assert client.pull_batch(client.plan, [byte_view(o) for o in outs], min_version=0) == [0, 0, 0]
    local = _local(client)
    local._authorization = ""  # as a client without the token
    pulls = [
        (Pull.of(client.model, s.shard_id, min_version=0), byte_view(o)) for s, o in zip(client.plan, outs, strict=True)
    ]
    answers = local.pull_batch(pulls, timeout=10)
    assert [a.code() for a in answers] == [grpc.StatusCode.UNAUTHENTICATED] * 3
    client.close()


@pytest.mark.parametrize(
    "inner, message",
    [
        (ps_pb2.DataRequest(attach=ps_pb2.LocalAttach(window=3)), "must carry a pull, a push, a batch"),
        (ps_pb2.DataRequest(batch=ps_pb2.DataBatch()), "must carry a pull, a push, a batch"),
        (ps_pb2.DataRequest(), "must carry a pull, a push, a batch"),
    ],
    ids=["an-attach", "a-batch", "nothing"],
)
def test_a_batch_answers_what_it_cannot_carry_alone_and_serves_the_rest(daemon, inner, message):
    client = _client(daemon.address, f"batch-inner-{inner.WhichOneof('kind')}")
    outs = _window(client)
    local = _local(client)
    ref = local._ref(byte_view(outs[0]))
    pull = ps_pb2.DataRequest(pull=Pull.of(client.model, 0, min_version=0).request, local=ref._asdict())
    with local._connection(30, fence=False) as conn:
        send_message(conn.sock, ps_pb2.DataRequest(batch=ps_pb2.DataBatch(requests=[inner, pull])))
        answer = recv_message(conn.sock, ps_pb2.DataResponse)
    assert answer.code == 0 and len(answer.answers) == 2
    assert answer.answers[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert message in answer.answers[0].message, answer.answers[0].message
    assert answer.answers[1].code == 0 and answer.answers[1].shard.version == 0
    assert outs[0][0].item() == 1.0
    client.close()


def test_an_empty_batch_is_answered_with_no_answers_and_the_connection_serves_on(daemon):
    client = _client(daemon.address, "batch-empty")
    local = _local(client)
    with local._connection(30, fence=False) as conn:
        send_message(conn.sock, ps_pb2.DataRequest(batch=ps_pb2.DataBatch()))
        answer = recv_message(conn.sock, ps_pb2.DataResponse)
        assert answer.code == 0 and len(answer.answers) == 0
        send_message(conn.sock, ps_pb2.DataRequest(batch=ps_pb2.DataBatch()))  # the same connection, again
        assert recv_message(conn.sock, ps_pb2.DataResponse).code == 0
    client.close()


def test_a_batch_on_the_tcp_data_plane_is_refused_saying_it_is_local_only(daemon):
    client = _client(daemon.address, "batch-tcp", transport="tcp")
    plane = client.transports[0]
    assert type(plane) is DataPlaneClient
    pull = ps_pb2.DataRequest(pull=Pull.of("batch-tcp", 0, min_version=0).request)
    with plane._connection(30) as sock:
        send_message(sock, ps_pb2.DataRequest(batch=ps_pb2.DataBatch(requests=[pull])))
        answer = recv_message(sock, ps_pb2.DataResponse)
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "a batch is for the local transport only" in answer.message
    client.close()


def test_a_daemon_of_protocol_2_gets_its_requests_one_by_one(daemon, monkeypatch):
    """A daemon from before batches (protocol 2) would refuse one: the trainer sends it none."""
    client = _client(daemon.address, "batch-protocol-2")
    local = _local(client)
    assert local.takes_batches
    answer = client.transports.clients[0].register(client.spec, 0, timeout=30)
    answer.protocol = 2  # as an older daemon answers
    client.transports.use_data_plane(0, answer, client.plan)
    assert client.transports[0] is local and not local.takes_batches
    assert client.batches(client.plan) == [[0], [1], [2]]

    def refused(*args, **kwargs):
        raise AssertionError("a batch was sent to a daemon of protocol 2")

    monkeypatch.setattr(LocalClient, "_batch", refused)
    outs = _window(client)
    assert client.pull_batch(client.plan, [byte_view(o) for o in outs], min_version=0) == [0, 0, 0]
    assert [o[0].item() for o in outs] == [1.0, 2.0, 3.0]
    client.close()
