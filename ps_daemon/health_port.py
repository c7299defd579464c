"""server.health_listen: a plaintext port serving grpc.health.v1 alone, for probes that cannot
speak TLS.

The kubelet's built-in gRPC probes connect in plaintext, so against a daemon whose port has
TLS they fail and a DaemonSet never becomes ready. This port answers them without opening
anything else in plaintext: a server of its own with the Health service only (any other
method is UNIMPLEMENTED). What it answers is not a flag set once at start: every
health_check_seconds the daemon checks itself through its main server (the watchdog's check:
its poller, its RPC threads, the data plane), and this port says SERVING only while that
check passes, NOT_SERVING from the first failure and from the start of a drain.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ps_offload.daemon.config import ServerConfig
from ps_offload.daemon.ownership import listener_of, port_in_use
from ps_offload.proto.frames import split_host_port

log = logging.getLogger(__name__)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class HealthPort:
    """The plaintext health port and the self-check that feeds it."""

    def __init__(self, listen: str, every: float) -> None:
        self.listen = listen
        self.every = every
        self.servicer = health.HealthServicer()
        self.servicer.set("", NOT_SERVING)  # until the first check passes
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
                                  options=[("grpc.so_reuseport", 0)])  # fmt: skip
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._problem: str | None = "not checked yet"

    @classmethod
    def of(cls, server: ServerConfig) -> HealthPort | None:
        return cls(server.health_listen, server.health_check_seconds) if server.health_listen else None

    def start(self, check: Callable[[float], str | None]) -> None:
        """Listens (OSError naming the key when it cannot) and checks the daemon now and then
        every `every` seconds; `check(timeout)` is None when the daemon serves."""
        try:
            self.port = self.server.add_insecure_port(self.listen)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            _, port = split_host_port(self.listen)
            if port and listener_of(port):
                raise OSError(port_in_use("server.health_listen", self.listen, port))
            raise OSError(f"cannot listen on {self.listen} (server.health_listen): not an address of this host")
        self.server.start()
        self._look(check)
        self._thread = threading.Thread(target=self._run, args=(check,), name="health-port", daemon=True)
        self._thread.start()
        log.info("plaintext health checks (grpc.health.v1 only) on port %d", self.port)

    def stop(self) -> None:
        """NOT_SERVING from now on (a drain), then the port closes with the daemon."""
        self._stopping.set()
        self.servicer.enter_graceful_shutdown()
        self.server.stop(1.0)

    def _run(self, check: Callable[[float], str | None]) -> None:
        while not self._stopping.wait(self.every):
            self._look(check)

    def _look(self, check: Callable[[float], str | None]) -> None:
        problem = check(min(5.0, self.every / 2))
        if self._stopping.is_set():
            return
        if problem != self._problem:
            if problem is None:
                log.info("health port: serving")
            else:
                log.warning("health port: NOT_SERVING: %s", problem)
        self._problem = problem
        self.servicer.set("", SERVING if problem is None else NOT_SERVING)
