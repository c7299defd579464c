"""Daemon lifecycle: build the gRPC server (data path, admin, health, reflection), recover,
listen and tell systemd; on SIGHUP reload what can change live; on SIGTERM/SIGINT stop taking
new calls, let in-flight ones finish within the grace period, and exit 0."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import queue
import resource
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ps_offload.daemon import cpus, systemd
from ps_offload.daemon.composition import open_store
from ps_offload.daemon.config import ConfigError, DaemonConfig, exposed_in_plaintext
from ps_offload.daemon.dataplane.local_pool import LocalPool
from ps_offload.daemon.dataplane.local_server import LocalServer
from ps_offload.daemon.dataplane.server import DataPlaneServer
from ps_offload.daemon.health_port import HealthPort
from ps_offload.daemon.metrics import DaemonMetrics
from ps_offload.daemon.model.optimizer import log_calibration
from ps_offload.daemon.ownership import DirectoryInUse, DirectoryLock, listener_of, port_in_use
from ps_offload.daemon.rpc import server_security
from ps_offload.daemon.rpc.call_bounds import CallBounds
from ps_offload.daemon.rpc.fronts import Fronts
from ps_offload.daemon.rpc.servicer import (
    AdminServicer,
    ParameterServerServicer,
    admin_handler,
    parameter_server_handler,
)
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.store.limits import StoreLimits
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.daemon.tiers.nvme import DirectIO, NvmeFiles
from ps_offload.kernels import step_calibration
from ps_offload.proto.channel import CHUNK_BYTES, SERVER_KEEPALIVE, SERVICE_NAMES, channel_options
from ps_offload.proto.frames import split_host_port
from ps_offload.proto.memory import keep_chunk_buffers_in_heap

log = logging.getLogger(__name__)

# Bulk streams move data in chunks of this size. Measured on loopback (docs/benchmarks.md):
# 1 MiB chunks stay in cache between the copy and the socket write and beat 4-8 MiB ones.

# Keys a SIGHUP applies to the running daemon. Every other changed key is logged as needing
# a restart and keeps its old value until then. grace_seconds is read when the drain starts.
LIVE_KEYS = frozenset({"log.level", "server.grace_seconds"})


class Daemon:
    """One running daemon: `start()` binds and serves, `stop()` drains and stops.
    watchdog: also take health checks on a private socket, for `check()`."""

    def __init__(self, config: DaemonConfig, *, watchdog: bool = False) -> None:
        self.config = config
        self.watchdog = watchdog
        keep_chunk_buffers_in_heap()
        # First: a directory another daemon holds must refuse before anything reads it.
        self.nvme_lock = _lock_nvme_dir(config)
        self.store = open_store(
            ram_bytes=config.store.ram_bytes,
            default_shard_bytes=config.store.shard_bytes,
            files=_open_nvme(config),
            prefetch_depth=config.store.prefetch_depth,
            limits=StoreLimits(
                max_models=config.store.max_models, max_shards_per_model=config.store.max_shards_per_model
            ),
            allow_nonfinite_pushes=config.store.allow_nonfinite_pushes,
            speculation_bytes=config.store.speculation_bytes,
        )
        # Idle staging kept for about as many concurrent pushes as usually arrive; more are
        # allocated on demand and dropped.
        staging = StagingPool(max_bytes=4 * config.store.shard_bytes)
        try:
            self.token = server_security.TokenCheck(config.auth)
        except ValueError as exc:
            raise OSError(f"auth.token_file: {exc}") from None
        self.metrics = DaemonMetrics(self.store) if config.metrics.listen else None
        self.data_plane = _bind_data_plane(
            config,
            self.store,
            staging,
            tls=server_security.server_ssl_context(config.tls),
            token=self.token,
            observe=self.metrics.observe_rpc if self.metrics else None,
            on_failure=self._data_plane_failed,
        )
        # Same-host clients: shared memory instead of loopback TCP; there when the data plane is.
        observe = self.metrics.observe_rpc if self.metrics else None
        pool = LocalPool.at_start(config.server.local_pool_bytes)  # refused here when the host lacks it
        local = dict(
            store=self.store,
            staging=staging,
            limits=config.server,
            pool=pool,
            token=self.token,
            observe=observe,
            # A batch's pushes side by side commit together; without NVMe there is nothing to group.
            pushes_at_once=config.store.nvme_spare_slots if config.store.nvme_dir else 1,
        )
        self.local = LocalServer.bind(**local) if self.data_plane else None
        self.health = health.HealthServicer()
        self.health_port = HealthPort.of(config.server)
        # Outermost first: a call refused for its token is still timed, with its code.
        interceptors = [self.metrics.interceptor()] if self.metrics else []
        interceptors.append(server_security.TokenInterceptor(self.token))
        # Innermost: it serves every method as request-streaming, to watch the wait for a request.
        self.call_bounds = CallBounds(
            per_client=config.server.max_calls_per_client or config.server.max_workers // 2,
            stall_seconds=config.server.data_stall_seconds,
        )
        interceptors.append(self.call_bounds)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.server.max_workers, thread_name_prefix="rpc"),
            # so_reuseport off: gRPC would otherwise let a second daemon listen on this port.
            options=[*channel_options(config.server.max_message_bytes), *SERVER_KEEPALIVE, ("grpc.so_reuseport", 0)],
            interceptors=interceptors,
        )
        parameter_server = ParameterServerServicer(
            self.store,
            max_pull_wait=config.server.max_pull_wait_seconds,
            chunk_bytes=CHUNK_BYTES,
            staging=staging,
            data_port=self.data_plane.port if self.data_plane else 0,
            local_endpoint=self.local.endpoint if self.local else "",
            nvme_tier=self.store.files.at_rest,
            max_waiting_pulls=config.server.max_waiting_pulls or config.server.max_workers // 2,
            max_waiting_pulls_per_client=config.server.max_waiting_pulls_per_client,
        )
        # What Stats and metrics say of the ways in.
        fronts = Fronts(parameter_server.peers, self.data_plane, self.local, self.call_bounds)
        self.server.add_generic_rpc_handlers(
            [
                parameter_server_handler(parameter_server),
                admin_handler(AdminServicer(self.store, parameter_server.pull_waits, fronts)),
            ]
        )
        if self.metrics is not None:
            self.metrics.watch_waits(parameter_server.pull_waits, fronts)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        self.port = 0
        self._probe_channel: grpc.Channel | None = None
        self._probe: health_pb2_grpc.HealthStub | None = None
        self._probe_dir: Path | None = None
        self._status = ""
        self._reload_note = ""  # what the last SIGHUP left undone, shown in STATUS
        self._stopping = False  # from here on STATUS stays "Stopping"

    def start(self) -> int:
        """Recovers, listens, and tells systemd READY=1 when trainers may connect."""
        if self.store.files.at_rest:  # (RAM only, nothing was kept)
            self._recover()
        listen = self.config.server.listen
        self._set_status(f"Starting: opening {listen}")
        credentials = server_security.server_credentials(self.config.tls)
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(listen)
            else:
                self.port = self.server.add_secure_port(listen, credentials)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            _, port = split_host_port(listen)
            if port and listener_of(port):
                raise OSError(port_in_use("server.listen", listen, port))
            raise OSError(
                f"cannot listen on {listen} (server.listen): not an address of this host, or the port is taken"
            )
        if self.watchdog or self.health_port is not None:
            self._open_probe()
        # The one-pass optimizer kernel is calibrated against this torch and compiled in the
        # background (kernels/step_calibration.py); pushes step with torch's kernels until then.
        # (Once the port is ours: a daemon that cannot start exits without Numba's threads.)
        step_calibration.start().add_done_callback(log_calibration)
        self.server.start()
        self.call_bounds.start()
        if self.data_plane is not None:
            self.data_plane.start()
            log.info("data plane listening on port %d", self.data_plane.port)
        if self.local is not None:
            self.local.start()
        if self.metrics is not None:
            self._serve_metrics()
        for name in ["", *SERVICE_NAMES]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.health_port is not None:
            self.health_port.start(self.check)
        log.info("ps-daemon listening on %s (port %d)", listen, self.port)
        if self.nvme_lock is not None:
            data = f", data plane port {self.data_plane.port}" if self.data_plane is not None else ""
            self.nvme_lock.note(f"pid {os.getpid()}, gRPC port {self.port}{data}")
        else:
            log.warning("no store.nvme_dir: RAM only, every model is lost when this daemon stops")
        exposed = exposed_in_plaintext(self.config)
        if exposed:  # only with server.insecure: validate() refuses it otherwise
            log.warning("INSECURE: %s serves plaintext beyond this host (--insecure; no [tls])", exposed)
        # The port file comes last, with READY=1: every shard is back, both ports accept calls,
        # and what start-up had to say is in the log (a script that waits for the file reads it).
        if self.config.server.port_file:
            _write_atomically(Path(self.config.server.port_file), f"{self.port}\n")
        self._status = self._serving_status()
        systemd.notify("READY=1", f"STATUS={self._status}")
        return self.port

    def _recover(self) -> None:
        # Before the port opens: nobody may see a shard until its committed version is back.
        where = self.store.files.dir
        models = _count(len(list(where.glob("*.json"))), "model")
        self._set_status(f"Starting: recovering {models} from {where} (reading slot headers)")
        started = time.monotonic()
        shards = self.store.registry.recover()
        took = time.monotonic() - started
        log.info("recovered %d shards from %s in %.1fs", shards, where, took)
        self._set_status(f"Starting: recovered {_count(shards, 'shard')} of {models} from {where} in {took:.1f}s")

    def _serve_metrics(self) -> None:
        """The metrics endpoint; one that cannot listen (a node agent on its port) is an ERROR
        and the daemon serves without it: its trainers need the daemon, not its metrics (a
        scraper sees the target down)."""
        listen = self.config.metrics.listen
        try:
            metrics_port = self.metrics.serve(listen)
        except OSError as exc:
            log.error("no metrics: %s; serving without them (set metrics.listen to a free port)", exc)
            return
        if self.config.metrics.port_file:
            _write_atomically(Path(self.config.metrics.port_file), f"{metrics_port}\n")
        log.info("metrics on http://%s:%d/metrics", listen.rpartition(":")[0], metrics_port)

    def _open_probe(self) -> None:
        # The watchdog's health checks come in here: through the same server (poller, RPC
        # threads, handlers) as a trainer's calls, but on a socket of their own in a 0700
        # directory, so they need neither TLS nor a token and nobody else can use it. (Under
        # systemd, in the unit's private /tmp, gone with the daemon however it ends.)
        self._probe_dir = Path(tempfile.mkdtemp(prefix="ps-daemon-"))
        address = f"unix:{self._probe_dir / 'health.sock'}"
        if not self.server.add_insecure_port(address):
            raise OSError(f"cannot listen on {address} (for the watchdog's health checks)")
        self._probe_channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
        self._probe = health_pb2_grpc.HealthStub(self._probe_channel)

    def check(self, timeout: float) -> str | None:
        """None when a health check through the running server answers SERVING within
        `timeout` seconds, else what went wrong (the watchdog's test). A hang looks like no
        answer: the poller stuck, or every RPC thread held (a deadlock in the store, or more
        Pulls waiting for versions than `server.max_workers`). Either way the STATUS line
        says it."""
        if self.data_plane is not None and self.data_plane.failure:
            problem = f"the data plane stopped ({self.data_plane.failure})"
        else:
            problem = self._probe_health(timeout)
        self._set_status(self._serving_status() if problem is None else f"Not serving: {problem}")
        return problem

    def _data_plane_failed(self, why: str) -> None:
        """The data plane's selector thread died: pulls and pushes can no longer reach this
        daemon, so health says NOT_SERVING (probes and orchestrators see it) and the watchdog's
        check fails, so that systemd restarts it."""
        for name in ["", *SERVICE_NAMES]:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._set_status(f"Not serving: the data plane stopped ({why})")

    def _probe_health(self, timeout: float) -> str | None:
        try:
            response = self._probe.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return (
                    f"a health check got no answer in {timeout:.1f}s "
                    f"(all {self.config.server.max_workers} RPC threads busy or stuck?)"
                )
            return f"a health check failed: {exc.code().name}: {exc.details()}"
        if response.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
        return None

    def _serving_status(self) -> str:
        stats = self.store.stats_snapshot()
        host = self.config.server.listen.rpartition(":")[0]
        data = f", data plane port {self.data_plane.port}" if self.data_plane is not None else ""
        text = (
            f"Serving on {host}:{self.port}{data}: {_count(stats.models, 'model')}, {_count(stats.shards, 'shard')}, "
            f"{_size(stats.ram_bytes_used)} of {_size(self.config.store.ram_bytes)} RAM"
        )
        if self.store.registry.damaged:
            text += f"; {_count(len(self.store.registry.damaged), 'model')} DAMAGED (ps-admin models)"
        if exposed_in_plaintext(self.config):
            text = f"INSECURE (plaintext beyond this host): {text}"
        return f"{text}; {self._reload_note}" if self._reload_note else text

    def _set_status(self, text: str) -> None:
        if text != self._status and not self._stopping:
            self._status = text
            systemd.notify(f"STATUS={text}")

    def reload(self, load: Callable[[], DaemonConfig] | None) -> None:
        """SIGHUP: re-reads the config with `load` (None: no file was given), applies the
        LIVE_KEYS and logs one line per other changed key, which waits for a restart. A file
        that no longer loads is logged and changes nothing. Tells systemd RELOADING=1, then
        READY=1 (also when the reload failed: the daemon serves on)."""
        systemd.notify("RELOADING=1", f"MONOTONIC_USEC={systemd.monotonic_usec()}", "STATUS=Reloading the config")
        self._status = ""  # READY=1 below always carries a STATUS, even an unchanged one
        self._reload_note = self._reload(load)
        self._status = self._serving_status()
        systemd.notify("READY=1", f"STATUS={self._status}")

    def _reload(self, load: Callable[[], DaemonConfig] | None) -> str:
        """Returns the note for the STATUS line: what is still waiting, or why it failed."""
        if load is None:
            log.info("reload: no --config file was given; nothing to re-read")
            return ""
        try:
            new = load()
        except ConfigError as exc:
            log.error("reload failed, still running with the previous config: %s", exc)
            return f"last reload failed ({exc}), running on the previous config"
        if self.token.token_file:
            try:
                self.token.reload()
                log.info("reload: re-read the token from %s", self.token.token_file)
            except ValueError as exc:
                log.error("reload: keeping the previous token: %s", exc)
        changes = config_changes(self.config, new)
        pending = [key for key, _, _ in changes if key not in LIVE_KEYS]
        for key, old, value in changes:
            if key in LIVE_KEYS:
                log.info("reload: %s %r -> %r, applied", key, old, value)
                self.config = _with_key(self.config, key, value)
            else:
                log.warning("reload: %s %r -> %r needs a restart; %r until then", key, old, value, old)
        logging.getLogger().setLevel(self.config.log.level.upper())
        log.debug("reload: running with %s", self.config)
        if not changes:
            log.info("reload: the config has not changed")
        return f"config changed, restart to apply {', '.join(pending)}" if pending else ""

    def stop(self) -> None:
        grace = self.config.server.grace_seconds
        log.info("stopping: draining in-flight calls for up to %.0fs", grace)
        self._stopping = True
        systemd.notify("STOPPING=1", f"STATUS=Stopping: draining in-flight calls for up to {grace:.0f}s")
        self.health.enter_graceful_shutdown()
        if self.health_port is not None:
            self.health_port.stop()
        stopped = self.server.stop(grace)
        if self.data_plane is not None:
            self.data_plane.stop(grace)
        if self.local is not None:
            self.local.stop(grace)
        stopped.wait()
        self.call_bounds.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self._probe_channel is not None:
            self._probe_channel.close()
        if self._probe_dir is not None:
            shutil.rmtree(self._probe_dir, ignore_errors=True)
        self.store.close()
        self.store.files.close()
        if self.nvme_lock is not None:
            self.nvme_lock.release()
        log.info("stopped")


def _lock_nvme_dir(config: DaemonConfig) -> DirectoryLock | None:
    """Holds store.nvme_dir for this daemon (None without one): missing, it is an error unless
    store.create_nvme_dir; held by another daemon, it is refused, naming that one."""
    store = config.store
    if not store.nvme_dir:
        return None
    directory = Path(store.nvme_dir)
    if not directory.exists():
        if not store.create_nvme_dir:
            raise OSError(
                f"store.nvme_dir {directory} does not exist: is the disk mounted, is the path right? Create it, "
                "or set store.create_nvme_dir (--create-nvme-dir) to have the daemon create it"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"store.nvme_dir: cannot create {directory}: {exc.strerror or exc}") from None
    if not directory.is_dir():
        raise OSError(f"store.nvme_dir {directory} is not a directory")
    try:
        return DirectoryLock(directory, key="store.nvme_dir", note=f"pid {os.getpid()}, starting")
    except DirectoryInUse:
        raise
    except OSError as exc:
        raise OSError(f"store.nvme_dir {directory}: cannot write there: {exc.strerror or exc}") from None


def _open_nvme(config: DaemonConfig) -> NvmeFiles | None:
    store = config.store
    if not store.nvme_dir:
        return None
    try:
        io = DirectIO(threads=store.io_threads, block_bytes=store.io_block_bytes, read_threads=store.io_read_threads)
        return NvmeFiles(
            store.nvme_dir,
            io=io,
            fsync=store.fsync,
            capacity=store.nvme_bytes,
            spare_slots=store.nvme_spare_slots,
            floor_seconds=store.nvme_floor_seconds,
        )
    except OSError as exc:
        raise OSError(f"store.nvme_dir {store.nvme_dir}: cannot use it: {exc.strerror or exc}") from exc


def _bind_data_plane(
    config: DaemonConfig, store: ShardStore, staging: StagingPool, **options
) -> DataPlaneServer | None:
    """The data plane server (not yet serving), or None when it is off. `options`: what
    DataPlaneServer takes for TLS, the token and metrics."""
    setting = config.server.data_listen
    if setting == "off":
        return None
    host, port = split_host_port(config.server.listen) if setting == "auto" else split_host_port(setting)
    if setting == "auto":
        port = 0
    _raise_open_files_limit(config.server.max_data_connections + _OTHER_DESCRIPTORS)
    try:
        return DataPlaneServer(
            (host, port),
            store=store,
            staging=staging,
            limits=config.server,
            **options,
        )
    except OSError as exc:
        key = "server.listen (data_listen auto)" if setting == "auto" else "server.data_listen"
        if exc.errno == errno.EADDRINUSE:
            raise OSError(port_in_use(key, f"{host}:{port}", port)) from None
        raise OSError(f"cannot listen for the data plane on {host}:{port} ({key}): {exc.strerror or exc}") from None


# Descriptors beside the data plane's connections: gRPC's, the arena and record files, logs.
_OTHER_DESCRIPTORS = 1024


def _raise_open_files_limit(needed: int) -> None:
    """Raises the soft limit on open descriptors toward the hard one, as far as `needed`: each
    data plane connection holds one, and a shell's default soft limit (often 1024) would refuse
    connections long before server.max_data_connections. Warns when the hard limit is short
    too (the systemd units set LimitNOFILE=65536)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < needed:
            log.warning(
                "open descriptors are limited to %d, below the %d that server.max_data_connections needs: "
                "connections past it are refused at accept; raise LimitNOFILE (ulimit -n) or lower "
                "server.max_data_connections",
                raised,
                needed,
            )


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def config_changes(old: DaemonConfig, new: DaemonConfig) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) of every key whose value differs, in config order."""
    changes = []
    for section in dataclasses.fields(old):
        before, after = getattr(old, section.name), getattr(new, section.name)
        for key in dataclasses.fields(before):
            if getattr(before, key.name) != getattr(after, key.name):
                changes.append((f"{section.name}.{key.name}", getattr(before, key.name), getattr(after, key.name)))
    return changes


def _with_key(config: DaemonConfig, dotted: str, value: object) -> DaemonConfig:
    section, key = dotted.split(".")
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **{key: value})})


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def run(config: DaemonConfig, *, reload: Callable[[], DaemonConfig] | None = None) -> int:
    """Serves until SIGTERM or SIGINT; on SIGHUP, `reload()` gives the config to apply (None:
    there is no file to re-read). Returns the process exit code."""
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()  # put() is safe in a signal handler

    def on_signal(signum: int, _frame: object) -> None:
        signals.put(signum)

    # Before anything slow: a SIGHUP's default action would kill a daemon that is still
    # recovering, and a SIGTERM then is served after start() (the drain finds nothing).
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    cpus.apply(cpus.plan(config.server.cpus, config.store.optimizer_threads, config.server.scheduling))  # (OSError)
    interval = systemd.watchdog_interval()
    daemon = Daemon(config, watchdog=interval is not None)
    daemon.start()
    watchdog = None
    if interval is not None:
        watchdog = systemd.Watchdog(interval, daemon.check)
        watchdog.start()
        log.info("watchdog: pinging systemd every %.1fs while health checks pass", interval / 2)
    while (signum := _next_signal(signals)) == signal.SIGHUP:
        log.info("received SIGHUP")
        daemon.reload(reload)
    log.info("received %s", signal.Signals(signum).name)
    if watchdog is not None:
        watchdog.stop()  # systemd stops watching at STOPPING=1; the drain makes checks fail
    daemon.stop()
    return 0


def _next_signal(signals: queue.SimpleQueue[int]) -> int:
    while True:
        # With a timeout: the main thread runs Python's signal handlers, and a signal the
        # kernel gave to another thread does not interrupt this wait; the timeout does.
        try:
            return signals.get(timeout=1.0)
        except queue.Empty:
            pass
