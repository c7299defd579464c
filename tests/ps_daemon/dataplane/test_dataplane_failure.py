"""A data plane whose selector thread dies is not hidden behind a healthy daemon: health says
NOT_SERVING and the watchdog's check fails naming it, so systemd restarts the daemon. The
fault is injected into the selector thread's accept (nothing else can make it raise)."""

from __future__ import annotations

import socket
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_offload.daemon.config import DaemonConfig, ServerConfig
from ps_offload.daemon.server import Daemon


def test_a_dead_selector_thread_makes_the_daemon_unhealthy(tmp_path):
    config = DaemonConfig(server=ServerConfig(listen="127.0.0.1:0"))
    daemon = Daemon(config, watchdog=True)
    died = threading.Event()
    plane = daemon.data_plane
    report = plane.on_failure
    plane.on_failure = lambda why: (report(why), died.set())

    def accept_fails() -> None:
        raise RuntimeError("injected")

    plane._accept = accept_fails
    daemon.start()
    try:
        assert daemon.check(timeout=10) is None  # serving until the data plane dies
        try:  # a connection to accept: the injected fault fires
            socket.create_connection(("127.0.0.1", plane.port), timeout=10).close()
        except ConnectionError:
            pass  # the listener closed as the connection was being made: the fault fired already
        assert died.wait(timeout=60)
        assert plane.failure == "RuntimeError: injected"
        problem = daemon.check(timeout=10)
        assert problem is not None and "RuntimeError: injected" in problem
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        daemon.stop()
