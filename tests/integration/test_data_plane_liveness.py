"""The data plane serves many connections with a bounded number of threads
(ps_daemon/dataplane/server.py): pulls waiting for a version are parked on their shard and hold no
worker, so the push that ends their wait is served by a pool of two; a waiting pull whose
client hangs up is unparked at once; one past its deadline is answered DEADLINE_EXCEEDED; a
request stalled half-sent holds no worker; connections past the per-client limit are refused,
naming it; and the daemon raises its descriptor limit to hold its connections."""

from __future__ import annotations

import resource
import shutil
import socket
import threading
from pathlib import Path

import grpc
import pytest
import torch

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2
from ps_offload.proto.frames import recv_exact_into, recv_message, send_message
from ps_offload.proto.push import Push
from tests.helpers.data_plane import NUMEL, register_with_data_plane
from tests.helpers.payloads import tensor_bytes
from tests.helpers.waiting import daemon_stats, until_stats

WORKERS = 2
WAITING = 40


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line in /proc/PID/status")


def _ask(port: int, shard_id: int, min_version: int, timeout_ms: int = 120_000) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    pull = ps_pb2.PullRequest(model="m", shard_id=shard_id, min_version=min_version)
    send_message(sock, ps_pb2.DataRequest(pull=pull, timeout_ms=timeout_ms))
    return sock


def _answer(sock: socket.socket) -> tuple[ps_pb2.DataResponse, torch.Tensor | None]:
    response = recv_message(sock, ps_pb2.DataResponse)
    if response.code:
        return response, None
    values = torch.empty(response.shard.numel)
    recv_exact_into(sock, tensor_bytes(values))
    return response, values


@pytest.fixture
def two_workers(daemon_factory, tmp_path):
    """A daemon whose data plane has two workers, and model "m" (3 shards, SGD lr 0.1) at
    version 0 with initial values 1."""
    config = tmp_path / "workers.toml"
    config.write_text(f"[server]\ndata_workers = {WORKERS}\n")
    daemon = daemon_factory(config=config)
    client, data, response = register_with_data_plane(daemon)
    for shard in response.shards:
        data.push(Push.parameters("m", shard.shard_id, tensor_bytes(torch.ones(shard.numel)), step=0), timeout=10)
    yield daemon, client, data, response.data_port
    data.close()
    client.close()


def test_waiting_pulls_hold_no_thread_and_the_push_they_wait_for_gets_through(two_workers):
    daemon, client, data, port = two_workers
    threads_before = _threads(daemon.process.pid)
    waiting = [_ask(port, 0, min_version=1) for _ in range(WAITING)]
    until_stats(lambda s: s.data_pulls_waiting == WAITING, f"{WAITING} pulls parked", client)
    # A thread per waiting pull would add WAITING (40); the pool adds at most its workers (and
    # gRPC's pool a few for the Stats calls, on a loaded machine).
    assert _threads(daemon.process.pid) <= threads_before + WORKERS + 4
    # Every worker would be held by a waiting pull if waits held workers: this push would starve.
    data.push(Push.gradient("m", 0, tensor_bytes(torch.ones(NUMEL)), step=0), timeout=30)
    expected = torch.ones(NUMEL)
    expected.add_(torch.ones(NUMEL), alpha=-0.1)
    for sock in waiting:
        response, values = _answer(sock)
        assert response.code == 0 and response.shard.version == 1
        assert torch.equal(values, expected)
        sock.close()
    assert daemon_stats(client).data_pulls_waiting == 0


def test_pulls_parked_for_versions_the_pushes_pass_each_get_theirs_bit_for_bit(two_workers):
    """Pulls park for versions 1..5 while the steps that make them are pushed: whether a pull
    parks before its commit, races it, or arrives after it, it gets a version at least the one
    it asked for, with exactly that version's values."""
    _, _, data, port = two_workers
    steps = 5
    values_at = [torch.ones(NUMEL)]
    for _ in range(steps):
        values_at.append(values_at[-1].clone().add_(torch.ones(NUMEL), alpha=-0.1))
    asked = [1 + i % steps for i in range(30)]
    answers: list[tuple[int, ps_pb2.DataResponse, torch.Tensor | None]] = []

    def pull(min_version: int) -> None:
        with _ask(port, 0, min_version=min_version) as sock:
            answers.append((min_version, *_answer(sock)))

    pullers = [threading.Thread(target=pull, args=(v,)) for v in asked]
    for i, thread in enumerate(pullers):
        thread.start()
        if i % 6 == 5:  # pushes interleaved with the pulls arriving
            step = i // 6
            data.push(Push.gradient("m", 0, tensor_bytes(torch.ones(NUMEL)), step=step), timeout=30)
    for thread in pullers:
        thread.join(timeout=120)
    assert len(answers) == len(asked)
    for min_version, response, values in answers:
        assert response.code == 0, response.message
        assert response.shard.version >= min_version
        assert torch.equal(values, values_at[response.shard.version])


def test_a_waiting_pull_whose_client_leaves_is_unparked_at_once(two_workers):
    _, client, _, port = two_workers
    waiting = [_ask(port, 1, min_version=5) for _ in range(3)]
    until_stats(lambda s: s.data_pulls_waiting == 3, "3 pulls parked", client)
    for sock in waiting:
        sock.close()
    until_stats(lambda s: s.data_pulls_waiting == 0, "the pulls unparked", client)


def test_a_waiting_pull_past_its_deadline_is_answered_deadline_exceeded(two_workers):
    _, client, data, port = two_workers
    with _ask(port, 2, min_version=7, timeout_ms=300) as sock:
        response, _ = _answer(sock)
        assert response.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert "still at version 0 after 0.3s; waited for version 7" in response.message
        send_message(sock, ps_pb2.DataRequest(pull=ps_pb2.PullRequest(model="m", shard_id=2)))
        response, values = _answer(sock)  # the connection serves on
        assert response.code == 0 and torch.equal(values, torch.ones(NUMEL))


def test_requests_stalled_half_sent_hold_no_worker(two_workers):
    _, _, _, port = two_workers
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(WORKERS + 1)]
    for sock in stalled:
        sock.sendall(b"\x20\x00")  # half of a frame's length
    with _ask(port, 1, min_version=0) as sock:
        response, values = _answer(sock)
    assert response.code == 0 and torch.equal(values, torch.ones(NUMEL))
    for sock in stalled:
        sock.close()


def test_connections_past_the_per_client_limit_are_refused_naming_it(daemon_factory, tmp_path):
    config = tmp_path / "per_client.toml"
    config.write_text("[server]\nmax_data_connections_per_client = 2\n")
    daemon = daemon_factory(config=config)
    client, data, response = register_with_data_plane(daemon)
    data.close()
    until_stats(lambda s: s.data_connections == 0, "the registration's connections closed", client)
    held = [socket.create_connection(("127.0.0.1", response.data_port), timeout=30) for _ in range(2)]
    with _ask(response.data_port, 0, min_version=0) as extra:
        refusal, _ = _answer(extra)
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "max_data_connections_per_client = 2" in refusal.message
    assert daemon_stats(client).data_connections_refused == 1
    for sock in held:
        sock.close()
    client.close()


def _open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no Max open files line in /proc/PID/limits")


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux) to start the daemon low")
def test_the_daemon_raises_its_descriptor_limit_for_its_connections(tmp_path):
    """Started with a soft limit of 256 descriptors (a connection holds one): the daemon raises
    it to what max_data_connections (4096) and its own files (1024) need, or to the hard limit
    with a warning that says what to raise."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    roomy = 65536 if hard == resource.RLIM_INFINITY else hard
    if roomy >= 4096 + 1024:
        with LocalDaemon(tmp_path / "roomy", launcher=("prlimit", f"--nofile=256:{roomy}")) as daemon:
            assert _open_files_limit(daemon.process.pid) == (4096 + 1024, roomy)
            assert "LimitNOFILE" not in daemon.log()
    with LocalDaemon(tmp_path / "short", launcher=("prlimit", "--nofile=256:2048")) as daemon:
        assert _open_files_limit(daemon.process.pid) == (2048, 2048)
        assert "below the 5120 that server.max_data_connections needs" in daemon.log()
