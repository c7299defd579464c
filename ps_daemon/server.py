"""Daemon lifecycle: build the gRPC server (data path, admin, health, reflection), listen,
and on SIGTERM/SIGINT stop taking new calls, let in-flight ones finish within the grace
period, and exit 0."""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ps_daemon.buffers import StagingPool
from ps_daemon.config import DaemonConfig
from ps_daemon.dataplane import DataPlaneServer
from ps_daemon.servicer import AdminServicer, ParameterServerServicer, admin_handler, parameter_server_handler
from ps_daemon.store import ShardStore
from ps_daemon.tiers.nvme import DirectIO, NvmeFiles
from ps_proto import ps_pb2
from ps_proto.frames import split_host_port
from ps_proto.memory import keep_chunk_buffers_in_heap

log = logging.getLogger(__name__)

# Bulk streams move data in chunks of this size. Measured on loopback (docs/benchmarks.md):
# 1 MiB chunks stay in cache between the copy and the socket write and beat 4-8 MiB ones.
CHUNK_BYTES = 1 << 20

SERVICE_NAMES = [ps_pb2.DESCRIPTOR.services_by_name[name].full_name for name in ("ParameterServer", "Admin")]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options both ends use: message limits, and no compression of already-dense floats."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class Daemon:
    """One running daemon: `start()` binds and serves, `stop()` drains and stops."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        keep_chunk_buffers_in_heap()
        self.files = _open_nvme(config)
        self.store = ShardStore(
            ram_bytes=config.store.ram_bytes,
            default_shard_bytes=config.store.shard_bytes,
            files=self.files,
            prefetch_depth=config.store.prefetch_depth,
        )
        # Idle staging kept for about as many concurrent pushes as usually arrive; more are
        # allocated on demand and dropped.
        staging = StagingPool(max_bytes=4 * config.store.shard_bytes)
        self.data_plane = _bind_data_plane(config, self.store, staging)
        self.health = health.HealthServicer()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.server.max_workers, thread_name_prefix="rpc"),
            options=channel_options(config.server.max_message_bytes),
        )
        self.server.add_generic_rpc_handlers(
            [
                parameter_server_handler(
                    ParameterServerServicer(
                        self.store,
                        max_pull_wait=config.server.max_pull_wait_seconds,
                        chunk_bytes=CHUNK_BYTES,
                        staging=staging,
                        data_port=self.data_plane.port if self.data_plane else 0,
                    )
                ),
                admin_handler(AdminServicer(self.store)),
            ]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        self.port = 0

    def start(self) -> int:
        if self.files is not None:
            # Before the port opens: nobody may see a shard until its committed version is back.
            started = time.monotonic()
            recovered = self.store.recover()
            log.info("recovered %d shards from %s in %.1fs", recovered, self.files.dir, time.monotonic() - started)
        listen = self.config.server.listen
        try:
            self.port = self.server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {listen}: {exc}") from exc
        if self.port == 0:
            raise OSError(f"cannot listen on {listen} (address in use or not local?)")
        Path(self.config.store.state_dir).mkdir(parents=True, exist_ok=True)
        self.server.start()
        if self.data_plane is not None:
            self.data_plane.start()
            log.info("data plane listening on port %d", self.data_plane.port)
        for name in ["", *SERVICE_NAMES]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.server.port_file:
            _write_atomically(Path(self.config.server.port_file), f"{self.port}\n")
        log.info("ps-daemon listening on %s (port %d)", listen, self.port)
        return self.port

    def stop(self) -> None:
        grace = self.config.server.grace_seconds
        log.info("stopping: draining in-flight calls for up to %.0fs", grace)
        self.health.enter_graceful_shutdown()
        stopped = self.server.stop(grace)
        if self.data_plane is not None:
            self.data_plane.stop(grace)
        stopped.wait()
        self.store.close()
        if self.files is not None:
            self.files.close()
        log.info("stopped")


def _open_nvme(config: DaemonConfig) -> NvmeFiles | None:
    store = config.store
    if not store.nvme_dir:
        return None
    try:
        io = DirectIO(threads=store.io_threads, block_bytes=store.io_block_bytes)
        return NvmeFiles(
            store.nvme_dir, io=io, fsync=store.fsync, capacity=store.nvme_bytes, spare_slots=store.nvme_spare_slots
        )
    except OSError as exc:
        raise OSError(f"cannot use nvme_dir {store.nvme_dir}: {exc.strerror or exc}") from exc


def _bind_data_plane(config: DaemonConfig, store: ShardStore, staging: StagingPool) -> DataPlaneServer | None:
    setting = config.server.data_listen
    if setting == "off":
        return None
    host, port = split_host_port(config.server.listen) if setting == "auto" else split_host_port(setting)
    if setting == "auto":
        port = 0
    try:
        return DataPlaneServer(
            (host, port), store=store, staging=staging, max_pull_wait=config.server.max_pull_wait_seconds
        )
    except OSError as exc:
        raise OSError(f"cannot listen for the data plane on {host}:{port}: {exc.strerror}") from exc


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run(config: DaemonConfig) -> int:
    """Serves until SIGTERM or SIGINT; returns the process exit code."""
    daemon = Daemon(config)
    stop_requested = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.start()
    stop_requested.wait()
    daemon.stop()
    return 0
