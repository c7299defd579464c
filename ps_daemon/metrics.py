"""Prometheus metrics (prometheus-client) on a port of their own: `metrics.listen`.

Two kinds, to keep the data path free of metric bookkeeping:
* histograms observed as things happen: every RPC's latency by method and status code (a
  gRPC server interceptor, and the data plane's requests as `DataPlane/Pull` and
  `DataPlane/Push`), and each shard's optimizer step;
* everything else read from the store's counters when Prometheus scrapes (`StatsSnapshot`,
  the same numbers `ps-admin stats` shows): bytes and calls in and out, shards and bytes per
  tier, prefetch hits and misses, NVMe bytes and seconds; and the pulls waiting for a
  version (per transport) and the data plane's connections.

Names follow Prometheus' conventions: a `ps_` prefix, base units (seconds, bytes), `_total`
on counters. The registry is the daemon's own, not the process-wide default, so that tests
can run several daemons' metrics in one process.
"""

from __future__ import annotations

import collections
import errno
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ps_offload.daemon.ownership import port_in_use
from ps_offload.daemon.rpc.handlers import rebuild
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.version import build_info

if TYPE_CHECKING:
    from ps_offload.daemon.rpc.fronts import Fronts
    from ps_offload.daemon.store.pull_wait import PullWaits

# From a small pull of a cached shard (~1 ms) to a pull that waits for its version or a
# 256 MiB shard read from disk (seconds).
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# One shard's optimizer step: ~2 ms for 4 MiB, ~40 ms for 64 MiB on one socket.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DaemonMetrics:
    """The daemon's registry, its histograms, and the collector over the store."""

    def __init__(self, store: ShardStore) -> None:
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram(
            "ps_rpc_duration_seconds",
            "Time to serve a call, by method (gRPC's full name without the package, or "
            "DataPlane/Pull and DataPlane/Push) and status code; a Pull's includes its wait for the version",
            ["method", "code"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.optimizer_seconds = Histogram(
            "ps_optimizer_step_duration_seconds",
            "One shard's optimizer update (the fused AdamW / SGD / 1-bit Adam kernel), without the commit",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        built = "The ps-offload release this daemon runs, and its Python, torch, grpcio, protobuf and numba"
        Info("ps_build", built, registry=self.registry).info(build_info())
        self.registry.register(_StoreCollector(store))
        store.on_optimizer_step = self.optimizer_seconds.observe
        self._server = None

    def watch_waits(self, pull_waits: PullWaits, fronts: Fronts) -> None:
        """Adds the pulls waiting now (per transport), the data plane's and the local
        transport's connections, the node's shared pool, and the clients on each path."""
        self.registry.register(_WaitsCollector(pull_waits, fronts))

    def observe_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.rpc_seconds.labels(method, code.name).observe(seconds)

    def interceptor(self) -> grpc.ServerInterceptor:
        return _TimingInterceptor(self)

    def serve(self, listen: str) -> int:
        """Starts the HTTP endpoint (GET /metrics) on host:port; returns the bound port."""
        host, _, port = listen.rpartition(":")
        try:
            self._server, _ = start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(port_in_use("metrics.listen", listen, int(port))) from None
            raise OSError(f"cannot listen for metrics on {listen} (metrics.listen): {exc.strerror or exc}") from None
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _StoreCollector(Collector):
    """The store's counters and tier use, read at each scrape."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    def collect(self) -> Iterator:
        s = self.store.stats_snapshot()
        yield _counter("ps_pulled_bytes", "Shard bytes sent to trainers by pulls", s.bytes_pulled)
        yield _counter("ps_pushed_bytes", "Payload bytes of pushes applied (compressed ones as sent)", s.bytes_pushed)
        yield _counter("ps_pulls", "Pulls served", s.pulls)
        yield _counter("ps_pulls_carried", "Pulls served in the push that made the version", s.pulls_carried)
        pushes = CounterMetricFamily("ps_pushes", "Pushes, by result", labels=["result"])
        pushes.add_metric(["applied"], s.pushes_applied)
        pushes.add_metric(["duplicate"], s.pushes_duplicate)  # a retry of an applied step
        yield pushes
        yield _counter("ps_optimizer_seconds", "Time in optimizer updates, all shards", s.optimizer_seconds)
        yield _counter("ps_prefetch_hints", "Shards named in trainers' Prefetch hints", s.prefetch_hints)
        yield _counter("ps_tier_hits", "Uses of a shard that was resident in RAM", s.tier_hits)
        yield _counter("ps_tier_misses", "Uses of a shard that had to be read from NVMe first", s.tier_misses)
        yield _counter("ps_prefetched_shards", "Shards read from NVMe ahead of use", s.prefetched)
        yield _counter("ps_evictions", "Shards dropped from the RAM tier", s.evictions)
        yield _counter("ps_nvme_read_bytes", "Shard bytes read from NVMe (loads, master-only pulls)", s.nvme_bytes_read)
        yield _counter("ps_nvme_written_bytes", "Shard bytes committed to NVMe", s.nvme_bytes_written)
        yield _counter("ps_nvme_read_seconds", "Time reading shards from NVMe, all threads", s.nvme_read_seconds)
        yield _counter("ps_nvme_write_seconds", "Time committing shards to NVMe, all threads", s.nvme_write_seconds)
        yield _counter(
            "ps_nvme_master_reads", "Pulls of a shard on NVMe that read its master values only", s.nvme_master_reads
        )
        yield _counter("ps_nvme_master_read_bytes", "Bytes those master-only reads took", s.nvme_master_bytes_read)
        yield _counter("ps_nvme_commits", "Shard versions made durable on NVMe", s.nvme_commits)
        yield _counter("ps_nvme_commit_groups", "Group commits those went to disk in", s.nvme_commit_groups)
        yield _counter("ps_nvme_flushes", "fdatasyncs of commits (one may cover several groups)", s.nvme_flushes)
        yield _counter("ps_nvme_flush_seconds", "Time in those fdatasyncs", s.nvme_flush_seconds)
        yield _counter(
            "ps_window_loads", "Master pulls that loaded the whole arena, kept until its update", s.window_loads
        )
        speculative = CounterMetricFamily(
            "ps_speculative_steps", "Steps computed during backward (push_in_backward), by outcome", labels=["result"]
        )
        speculative.add_metric(["adopted"], s.speculative_steps)
        speculative.add_metric(["redone"], s.speculative_redone)  # the APPLY named other settings
        yield speculative
        yield GaugeMetricFamily(
            "ps_speculation_bytes", "Spare shard state held for steps computed ahead", value=s.speculation_bytes
        )
        shards = GaugeMetricFamily("ps_shards", "Shards held, by tier", labels=["tier"])
        for tier, count in (("ram", s.shards_in_ram), ("nvme", s.shards_on_nvme), ("corrupt", s.shards_corrupt)):
            shards.add_metric([tier], count)
        yield shards
        tier_bytes = GaugeMetricFamily("ps_tier_bytes", "Bytes used by tier (RAM: resident arenas)", labels=["tier"])
        tier_bytes.add_metric(["ram"], s.ram_bytes_used)
        tier_bytes.add_metric(["nvme"], s.nvme_bytes_allocated)
        yield tier_bytes
        capacity = GaugeMetricFamily("ps_tier_capacity_bytes", "Configured budget by tier (0: none)", labels=["tier"])
        capacity.add_metric(["ram"], s.ram_bytes_budget)
        capacity.add_metric(["nvme"], s.nvme_bytes_capacity)
        yield capacity
        lost = GaugeMetricFamily(
            "ps_replica_lost_holders", "Daemons of a replicated model its trainer reports lost", labels=["model"]
        )
        degraded = GaugeMetricFamily(
            "ps_replica_degraded_shards", "Shards held here that a lost holder leaves a replica short", labels=["model"]
        )
        for health in self.store.replica_health():
            lost.add_metric([health.model], len(health.lost_holders))
            degraded.add_metric([health.model], health.degraded_shards)
        yield lost
        yield degraded
        yield GaugeMetricFamily("ps_models", "Models registered", value=s.models)
        yield GaugeMetricFamily("ps_uptime_seconds", "Seconds since the daemon started", value=s.uptime_seconds)


class _WaitsCollector(Collector):
    """Pulls waiting for a version and data plane connections, read at each scrape."""

    def __init__(self, pull_waits: PullWaits, fronts: Fronts) -> None:
        self.pull_waits = pull_waits
        self.fronts = fronts

    def collect(self) -> Iterator:
        plane, local = self.fronts.data_plane, self.fronts.local
        waiting = GaugeMetricFamily(
            "ps_pulls_waiting", "Pulls waiting for a version not pushed yet, by transport", labels=["transport"]
        )
        waiting.add_metric(["grpc"], self.pull_waits.waiting)  # each holds an RPC thread
        waiting.add_metric(["data_plane"], plane.parked_pulls if plane else 0)  # parked, no thread
        yield waiting
        yield _counter(
            "ps_pulls_refused_waiting",
            "gRPC pulls refused because server.max_waiting_pulls (or _per_client) were waiting",
            self.pull_waits.refused,
        )
        calls = self.fronts.calls
        yield _counter(
            "ps_rpc_calls_refused_busy",
            "gRPC calls refused because server.max_calls_per_client calls from that address were running",
            calls.refused if calls else 0,
        )
        yield _counter(
            "ps_rpc_calls_cut_off",
            "gRPC calls cancelled because their client moved no bytes for server.data_stall_seconds",
            calls.cancelled if calls else 0,
        )
        yield GaugeMetricFamily(
            "ps_data_connections", "Data plane connections open", value=plane.connections if plane else 0
        )
        yield _counter(
            "ps_data_connections_refused",
            "Data plane connections refused for server.max_data_connections or _per_client",
            plane.refused if plane else 0,
        )
        yield GaugeMetricFamily(
            "ps_local_connections",
            "Local shared-memory transport connections open",
            value=local.connections if local else 0,
        )
        yield _counter(
            "ps_local_connections_refused",
            "Local transport connections refused (another uid, or server.max_data_connections_per_client)",
            local.refused if local else 0,
        )
        yield GaugeMetricFamily(
            "ps_local_pool_bytes",
            "The node's shared pool (server.local_pool_bytes)",
            value=local.pool_bytes if local else 0,
        )
        yield GaugeMetricFamily(
            "ps_local_pool_bytes_used",
            "Bytes of the node's shared pool attached by its ranks now",
            value=local.pool_bytes_used if local else 0,
        )
        clients = GaugeMetricFamily(
            "ps_clients", "Clients moving bytes over each path (grpc: in the last minute)", labels=["transport"]
        )
        by_path = collections.Counter(path.transport for path in self.fronts.client_paths())
        for transport in ("local", "data", "grpc"):
            clients.add_metric([transport], by_path[transport])
        yield clients


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


class _TimingInterceptor(grpc.ServerInterceptor):
    """Times every call into `rpc_seconds`: unary replies when the handler returns, streamed
    replies when the stream ends; the code is the one the call ended with."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit(".", 1)[-1]  # "/ps.v1.Admin/Stats" -> "Admin/Stats"
        observe = self.metrics.observe_rpc
        return rebuild(
            handler, lambda behaviour, streams: (_timed_stream if streams else _timed)(behaviour, method, observe)
        )


def _timed(behaviour: Callable, method: str, observe: Callable) -> Callable:
    def call(request, context):
        started, failed = time.perf_counter(), grpc.StatusCode.UNKNOWN  # what gRPC makes of a raise
        try:
            result = behaviour(request, context)
            failed = grpc.StatusCode.OK
            return result
        finally:
            observe(method, context.code() or failed, time.perf_counter() - started)

    return call


def _timed_stream(behaviour: Callable, method: str, observe: Callable) -> Callable:
    def call(request, context):
        started, failed = time.perf_counter(), grpc.StatusCode.CANCELLED  # closed early: the client left
        try:
            yield from behaviour(request, context)
            failed = grpc.StatusCode.OK
        except Exception:
            failed = grpc.StatusCode.UNKNOWN
            raise
        finally:
            observe(method, context.code() or failed, time.perf_counter() - started)

    return call
