"""Nothing a client does with pulls stops a daemon from answering (ps_daemon/store/pull_wait.py):
pulls waiting for a version no one pushes are bounded, those past the bound are refused at
once with RESOURCE_EXHAUSTED naming the limit, health checks and other calls are still
served meanwhile, and a waiting pull whose caller cancels gives its thread back at once
(it used to wait out its timeout, holding the thread)."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.pull import Pull
from ps_offload.proto.push import Push
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.sharded_client import ShardedClient
from tests.helpers.payloads import tensor_bytes
from tests.helpers.specs import sgd_spec
from tests.helpers.waiting import daemon_stats, until_stats

WORKERS = 8  # max_waiting_pulls 0: half of them, 4


class Puller:
    """A pull of shard 0 at `min_version`, on a thread of its own: its outcome once it ends."""

    def __init__(self, stub: ps_pb2_grpc.ParameterServerStub, min_version: int, done: threading.Semaphore) -> None:
        self.call = stub.Pull(ps_pb2.PullRequest(model="m", shard_id=0, min_version=min_version), timeout=120)
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._done = done
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            list(self.call)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code, self.details = error.code(), error.details()
        self._done.release()


def _initialize(client: DaemonClient) -> None:
    client.register(sgd_spec(), 0, timeout=10)
    for shard_id, n in enumerate((1024, 1024, 952)):
        client.push(Push.parameters("m", shard_id, tensor_bytes(torch.ones(n)), step=0), timeout=10)


@pytest.mark.slow
def test_waiting_pulls_are_bounded_refused_past_the_bound_and_freed_by_their_callers_leaving(daemon_factory, tmp_path):
    config = tmp_path / "workers.toml"
    # One client here: the per-client bound as high as the whole (the next test shares them out).
    config.write_text(
        f"[server]\nmax_workers = {WORKERS}\nmax_waiting_pulls_per_client = {WORKERS // 2}\n"
        f"max_calls_per_client = {WORKERS}\n"
    )
    daemon = daemon_factory(config=config)
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    _initialize(client)
    stub = ps_pb2_grpc.ParameterServerStub(client.channel)
    ended = threading.Semaphore(0)
    pullers = [Puller(stub, min_version=5, done=ended) for _ in range(3 * WORKERS)]  # version 5 never comes
    limit = WORKERS // 2
    for _ in range(len(pullers) - limit):  # the refused ones end at once
        assert ended.acquire(timeout=60)
    refused = [p for p in pullers if p.code is not None]
    assert len(refused) == len(pullers) - limit
    for p in refused:
        assert p.code == grpc.StatusCode.RESOURCE_EXHAUSTED, p.details
        assert "server.max_waiting_pulls = 4" in p.details and "raise server.max_waiting_pulls" in p.details
    stats = daemon_stats(client)
    assert stats.pulls_waiting == limit and stats.pulls_refused_waiting == len(refused)
    # The other threads still serve: health, admin calls, a pull of a version that exists, a push.
    health = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    out = torch.empty(1024)
    assert client.pull_into(Pull.of("m", 1, min_version=0), out=tensor_bytes(out), timeout=10) == 0
    ack = client.push(Push.gradient("m", 1, tensor_bytes(torch.ones(1024)), step=0), timeout=10)
    assert ack.applied
    # The waiting callers leave: each wait ends at once and its slot is free again.
    waiting = [p for p in pullers if p.code is None]
    for p in waiting:
        p.call.cancel()
    until_stats(lambda s: s.pulls_waiting == 0, "no pull waiting after the callers cancelled", client)
    for p in waiting:
        p.thread.join(timeout=60)
        assert p.code == grpc.StatusCode.CANCELLED
    # Room for as many waiting pulls as before, and a push that makes their version wakes them.
    again = [Puller(stub, min_version=1, done=ended) for _ in range(limit)]
    until_stats(lambda s: s.pulls_waiting == limit, "the new pulls waiting", client)
    ack = client.push(Push.gradient("m", 0, tensor_bytes(torch.ones(1024)), step=0), timeout=10)
    assert ack.applied and ack.version == 1
    for p in again:
        p.thread.join(timeout=60)
        assert p.code == grpc.StatusCode.OK, p.details
    client.close()


def test_a_trainers_pull_refused_for_waiting_is_retried_until_there_is_room(daemon_factory, tmp_path):
    """Another client's pulls hold every waiting slot: the trainer's pull of a version not
    pushed yet is refused RESOURCE_EXHAUSTED, backs off and retries (as the refusal says), and
    gets its version once the slots free and the version is pushed, instead of failing the job."""
    config = tmp_path / "workers.toml"
    # 2 waiting pulls at most; one host may hold every thread (the trainer and the other client).
    config.write_text("[server]\nmax_workers = 4\nmax_waiting_pulls_per_client = 2\nmax_calls_per_client = 4\n")
    daemon = daemon_factory(config=config)
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    _initialize(client)
    stub = ps_pb2_grpc.ParameterServerStub(client.channel)
    ended = threading.Semaphore(0)
    hogs = [Puller(stub, min_version=99, done=ended) for _ in range(2)]
    until_stats(lambda s: s.pulls_waiting == 2, "the other client's pulls holding both waiting slots", client)

    trainer_client = ShardedClient(
        [daemon.address], config=ClientConfig(transport="grpc", retry_seconds=60, backoff_seconds=0.05)
    )
    plan = trainer_client.register(sgd_spec())
    got: list[int] = []
    pulling = threading.Thread(
        target=lambda: got.append(trainer_client.pull(plan[0], min_version=1, out=tensor_bytes(torch.empty(1024))))
    )
    pulling.start()
    until_stats(lambda s: s.pulls_refused_waiting >= 2, "the trainer's pull refused, and refused again", client)
    for hog in hogs:
        hog.call.cancel()
    ack = client.push(Push.gradient("m", 0, tensor_bytes(torch.ones(1024)), step=0), timeout=10)
    assert ack.applied
    pulling.join(timeout=60)
    assert got == [1]
    trainer_client.close()
    client.close()


def test_one_client_address_cannot_take_every_waiting_slot(tmp_path):
    """max_workers 8: 4 gRPC pulls may wait, 2 from one address (the default, half). A daemon
    on "localhost" is reached from 127.0.0.1 and from ::1, two client addresses: the first's
    third waiting pull is refused naming the per-client key, and the second's two still wait."""
    config = tmp_path / "workers.toml"
    config.write_text(f"[server]\nmax_workers = {WORKERS}\n")
    with LocalDaemon(tmp_path / "d", "--config", str(config), host="localhost") as daemon:
        v4 = DaemonClient(f"127.0.0.1:{daemon.port}", max_message_bytes=8 << 20)
        v6 = DaemonClient(f"[::1]:{daemon.port}", max_message_bytes=8 << 20)
        _initialize(v4)
        ended = threading.Semaphore(0)
        first = [Puller(ps_pb2_grpc.ParameterServerStub(v4.channel), 5, ended) for _ in range(3)]
        assert ended.acquire(timeout=60)  # the refused one ends at once
        (refused,) = [p for p in first if p.code is not None]
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "127.0.0.1 has 2 pulls waiting" in refused.details
        assert "server.max_waiting_pulls_per_client = 2" in refused.details
        second = [Puller(ps_pb2_grpc.ParameterServerStub(v6.channel), 5, ended) for _ in range(2)]
        until_stats(lambda s: s.pulls_waiting == 4, "two pulls from each address waiting", v4)
        assert daemon_stats(v4).pulls_refused_waiting == 1
        for p in first + second:
            p.call.cancel()
            p.thread.join(timeout=60)
        v4.close()
        v6.close()
