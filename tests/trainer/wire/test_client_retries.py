"""The client's retry budget is a time, not a count (trainer/wire/sharded_client.py `_call`): a daemon that
takes longer than a fixed number of attempts to restart is still waited for, and one gone
for good fails the call once the budget is spent. A fake clock stands in for time."""

from __future__ import annotations

import grpc
import pytest

from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire import sharded_client as client_module
from ps_offload.trainer.wire.daemon_client import DaemonError
from ps_offload.trainer.wire.sharded_client import ShardedClient


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused (injected)"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(client_module.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(client_module.time, "sleep", fake.sleep)
    return fake


def _down_for(clock: FakeClock, seconds: float):
    """A call that fails UNAVAILABLE until `seconds` of (fake) time have passed."""
    up_at = clock.now + seconds

    def call() -> str:
        if clock.now < up_at:
            raise Unavailable()
        return "answered"

    return call


def test_a_daemon_down_for_longer_than_many_attempts_is_waited_for_within_the_budget(clock):
    client = ShardedClient(["127.0.0.1:1"], config=ClientConfig(retry_seconds=60.0, backoff_seconds=0.1))
    assert client.call("pull", 0, _down_for(clock, 40.0)) == "answered"
    assert len(clock.sleeps) > 8  # more attempts than the old fixed count of 8
    assert max(clock.sleeps) <= 2.0  # the backoff's cap
    client.close()


def test_a_daemon_gone_for_good_fails_the_call_once_the_budget_is_spent(clock):
    client = ShardedClient(["127.0.0.1:1"], config=ClientConfig(retry_seconds=10.0, backoff_seconds=0.1))
    started = clock.now
    with pytest.raises(DaemonError, match="UNAVAILABLE"):
        client.call("pull", 0, _down_for(clock, 1e9))
    assert clock.now - started == pytest.approx(10.0)  # the last sleep is cut to what is left
    client.close()


def test_no_retry_budget_fails_at_the_first_transient_error(clock):
    client = ShardedClient(["127.0.0.1:1"], config=ClientConfig(retry_seconds=0.0))
    with pytest.raises(DaemonError):
        client.call("pull", 0, _down_for(clock, 1.0))
    assert clock.sleeps == []
    client.close()


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "5", True])
def test_a_retry_budget_that_is_not_a_finite_time_is_refused(bad):
    with pytest.raises(ValueError, match="ClientConfig.retry_seconds must be a finite number of seconds"):
        ClientConfig(retry_seconds=bad)
