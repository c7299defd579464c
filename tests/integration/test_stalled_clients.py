"""No client can stall the daemon (ps_daemon/rpc/call_bounds.py): twice as many stalled gRPC
clients as the daemon has RPC threads, of each kind (a Push that sends its header and 1 MiB of its
payload and stops; a Pull of a 64 MiB shard whose client reads one chunk and stops reading; a
call whose request message never comes), and health checks still answer within a second.
Those past the client's budget are refused at once, marked busy; the stalled ones are cut off
after server.data_stall_seconds, and then the same host is served again."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from bench.stalled_clients import OWN_CONNECTION, Stalled, health_seconds, register_model
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.channel import BUSY_METADATA
from ps_offload.trainer.wire.daemon_client import busy

WORKERS = 8
STALLED = 2 * WORKERS
STALL_SECONDS = 4.0


def _stallable(daemon_factory, tmp_path, stall_seconds: float):
    config = tmp_path / "stall.toml"
    config.write_text(f"[server]\nmax_workers = {WORKERS}\ndata_stall_seconds = {stall_seconds}\n")
    daemon = daemon_factory(config=config)
    register_model(daemon.address)
    return daemon


@pytest.fixture
def stallable(daemon_factory, tmp_path):
    return _stallable(daemon_factory, tmp_path, STALL_SECONDS)


@pytest.mark.parametrize("kind", ["push", "pull", "request"])
def test_twice_as_many_stalled_clients_as_threads_leave_health_answering(stallable, kind):
    daemon = stallable
    release, ends = threading.Event(), threading.Semaphore(0)
    created_at = time.monotonic()
    clients = [Stalled(daemon.address, kind, release, ends) for _ in range(STALLED)]
    try:
        # Past the host's budget (half the threads) they are refused at once, marked busy.
        budget = WORKERS // 2
        for _ in range(STALLED - budget):
            assert ends.acquire(timeout=60)
        refused = [c for c in clients if c.ended.is_set()]
        assert all(c.code == grpc.StatusCode.RESOURCE_EXHAUSTED and BUSY_METADATA in c.metadata for c in refused)
        # The rest hold their threads, stalled; health answers regardless: within a second on
        # a quiet machine (bench/stalled_clients.py), where without the bounds it got no answer
        # in 5 s; the margin is for a loaded one.
        assert max(health_seconds(daemon.address) for _ in range(5)) < 2.0
        # ... and they are cut off after data_stall_seconds, which frees the host's budget: the
        # same host is served again (a busy answer until then).
        _stats_answer_once_not_busy(daemon.address)
        assert time.monotonic() - created_at >= STALL_SECONDS  # not before its stall was long enough
        assert "its client moved no bytes for 4s (server.data_stall_seconds)" in daemon.log()
        if kind != "pull":  # (a pull's client still holds the chunks it had buffered before it sees the end)
            for c in clients:
                assert c.ended.wait(60) and c.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        release.set()
        for c in clients:
            c.close()


def _stats_answer_once_not_busy(address: str) -> None:
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        deadline = time.monotonic() + STALL_SECONDS + 60
        while True:
            try:
                assert ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10).models == 1
                return
            except grpc.RpcError as error:
                assert busy(error) and time.monotonic() < deadline, f"{error.code()}: {error.details()}"
            time.sleep(0.2)


def test_a_busy_refusal_is_retryable_and_others_are_not(daemon_factory, tmp_path):
    """The trainer's client retries RESOURCE_EXHAUSTED only when the daemon marked it busy."""
    daemon = _stallable(daemon_factory, tmp_path, 120.0)  # nothing is cut off meanwhile, however slow the machine
    release, ends = threading.Event(), threading.Semaphore(0)
    clients = [Stalled(daemon.address, "request", release, ends) for _ in range(WORKERS // 2 + 1)]
    try:
        assert ends.acquire(timeout=60)
        refused = next(c for c in clients if c.ended.is_set())
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with grpc.insecure_channel(daemon.address, options=OWN_CONNECTION) as channel:
            with pytest.raises(grpc.RpcError) as busy_error:
                ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10)
        assert busy(busy_error.value) and "server.max_calls_per_client" in busy_error.value.details()
    finally:
        release.set()
        for c in clients:
            c.close()
    # A RESOURCE_EXHAUSTED of another kind (a registration past the RAM budget) is not busy.
    with grpc.insecure_channel(daemon.address) as channel:
        too_big = ps_pb2.ModelSpec(
            model="big",
            params=[ps_pb2.ParamSpec(name="w", shape=[1 << 40], dtype=ps_pb2.FLOAT32)],
            optimizer=ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=1.0)),
            daemons=["d0"],
        )
        with pytest.raises(grpc.RpcError) as final:
            ps_pb2_grpc.ParameterServerStub(channel).RegisterModel(
                ps_pb2.RegisterModelRequest(spec=too_big, daemon_index=0), timeout=10
            )
    assert final.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not busy(final.value)
