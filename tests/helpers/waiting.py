"""Waiting on events rather than clocks: a predicate polled until it holds, or a daemon's
Stats asked until they say it did, each for at most 60 s and failing with what never came."""

from __future__ import annotations

import threading

from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.trainer.wire.daemon_client import DaemonClient


def until(predicate, what: str) -> None:
    deadline = threading.Event()
    timer = threading.Timer(60, deadline.set)
    timer.start()
    try:
        while not predicate():
            assert not deadline.wait(0.05), f"never happened: {what}"
    finally:
        timer.cancel()


def daemon_stats(client: DaemonClient) -> ps_pb2.StatsResponse:
    return ps_pb2_grpc.AdminStub(client.channel).Stats(ps_pb2.StatsRequest(), timeout=10)


def until_stats(predicate, what: str, client: DaemonClient) -> None:
    """Asks the daemon's Stats until `predicate(stats)` holds (each answer is an event: the
    daemon's own count), for at most 60 s."""
    deadline = threading.Event()
    timer = threading.Timer(60, deadline.set)
    timer.start()
    try:
        while not predicate(daemon_stats(client)):
            assert not deadline.wait(0.05), f"the daemon never reached: {what} ({daemon_stats(client)})"
    finally:
        timer.cancel()
