"""The trainer's side of the wire: push, pull and wait, ps-lite style.

`DaemonClient` talks to one daemon. `ShardedClient` holds the plan and a client per daemon
and moves one shard at a time, with deadlines and retries. Retrying is safe: a push is
applied at most once per (shard, step) and a pull only reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import torch

from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.channel import (
    BUSY_METADATA,
    MIN_DAEMON_PROTOCOL,
    channel_options,
    keepalive_options,
    method_path,
)
from ps_offload.proto.cluster import check_daemon_list
from ps_offload.proto.frames import split_host_port
from ps_offload.proto.memory import keep_chunk_buffers_in_heap
from ps_offload.proto.plan import ShardSlice, layout_params, plan_shards, shard_numel_for, shard_starts
from ps_offload.proto.pull import read_pull_stream
from ps_offload.proto.push import Push
from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient, DataPlaneError
from ps_offload.trainer.wire.host_windows import HostWindows, Prepare
from ps_offload.trainer.wire.local_client import LocalClient, slot_bytes_for
from ps_offload.trainer.wire.transport import Transport
from ps_offload.version import release as ps_offload_release

log = logging.getLogger(__name__)

T = TypeVar("T")
# A push is retried when the daemon was unreachable or the attempt ran out of time: it is
# idempotent on (shard, step). A pull is retried when unreachable, and when refused because
# as many pulls as the daemon allows are waiting for versions already (server.max_waiting_
# pulls: its message says to retry later; with backoff, that is the retry). Not on
# DEADLINE_EXCEEDED: there the version usually never came, and waiting again would repeat it.
PUSH_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
PULL_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# gRPC backs off reconnecting after failures, 1 s growing to 120 s by default; a daemon that
# systemd restarts is back within seconds, and a trainer waiting minutes for it loses steps.
# Reconnect attempts every 100 ms to 1 s instead (one TCP connect each: cheap on a cluster).
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def check_protocol(address: str, response: ps_pb2.RegisterModelResponse) -> None:
    """Refuses a daemon too old for this trainer, naming both releases, before any push."""
    if response.protocol < MIN_DAEMON_PROTOCOL:
        release = response.daemon_version or "a release from before 0.1.0"
        raise RuntimeError(
            f"daemon {address} runs ps-offload {release} (protocol {response.protocol}), older than this trainer "
            f"({ps_offload_release()}) needs (protocol {MIN_DAEMON_PROTOCOL} or later): upgrade the daemons "
            "(docs/deploy.md, rolling upgrade), or run the trainer's release that matches them"
        )


def busy(error: grpc.RpcError) -> bool:
    """A refusal that only says the daemon is busy now (too many calls from this host at
    once): retried like an unreachable daemon, where other RESOURCE_EXHAUSTEDs are final."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    trailing = getattr(error, "trailing_metadata", None)
    return BUSY_METADATA in [tuple(m) for m in (trailing() if trailing else None) or ()]


UNREACHABLE_AFTER = 2.0  # seconds without an answer before registration says it is waiting


class DaemonError(RuntimeError):
    """A daemon refused a call or could not be reached; the message names both ends."""

    def __init__(self, address: str, what: str, error: grpc.RpcError) -> None:
        self.address = address
        self.code = error.code()
        hint = ""
        if self.code == grpc.StatusCode.UNAVAILABLE:
            hint = (
                " (is the daemon up and its port reachable? If it uses TLS, ClientConfig.security must name the CA "
                "that signed its certificate, and a client certificate from its client CA under mutual TLS)"
            )
        super().__init__(f"{what} on daemon {address}: {self.code.name}: {error.details()}{hint}")


def _identity(data: bytes) -> bytes:
    return data


class DaemonClient:
    """One channel to one daemon and its data-path methods."""

    def __init__(
        self,
        address: str,
        *,
        max_message_bytes: int,
        security: ClientSecurity | None = None,
        dead_peer_seconds: float = 10.0,
    ) -> None:
        self.address = address
        keep_chunk_buffers_in_heap()
        security = security or ClientSecurity()
        options = [*channel_options(max_message_bytes), *RECONNECT, *keepalive_options(dead_peer_seconds)]
        self.channel = security.channel(address, options)
        self._register = self.channel.unary_unary(
            method_path("ParameterServer", "RegisterModel"),
            request_serializer=ps_pb2.RegisterModelRequest.SerializeToString,
            response_deserializer=ps_pb2.RegisterModelResponse.FromString,
        )
        self._pull = self.channel.unary_stream(
            method_path("ParameterServer", "Pull"),
            request_serializer=ps_pb2.PullRequest.SerializeToString,
            response_deserializer=codec.pull_chunks.decode,
        )
        self._push = self.channel.stream_unary(
            method_path("ParameterServer", "Push"),
            request_serializer=_identity,
            response_deserializer=ps_pb2.PushResponse.FromString,
        )
        self._prefetch = self.channel.unary_unary(
            method_path("ParameterServer", "Prefetch"),
            request_serializer=ps_pb2.PrefetchRequest.SerializeToString,
            response_deserializer=ps_pb2.PrefetchResponse.FromString,
        )

    def register(self, spec: ps_pb2.ModelSpec, daemon_index: int, *, timeout: float) -> ps_pb2.RegisterModelResponse:
        """Waits up to `timeout` for the daemon to come up (systemd may be restarting it)."""
        request = ps_pb2.RegisterModelRequest(spec=spec, daemon_index=daemon_index)
        try:
            return self._register(request, timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        # Waiting hides why no connection came up (a refused port, a failed TLS handshake):
        # one attempt that does not wait reports it as UNAVAILABLE with gRPC's reason.
        return self._register(request, timeout=min(timeout, 5.0), wait_for_ready=False)

    def pull_into(
        self,
        model: str,
        shard_id: int,
        *,
        min_version: int,
        out: memoryview,
        timeout: float,
        tensor: int = ps_pb2.MASTER,
        dtype: int = ps_pb2.FLOAT32,
    ) -> int:
        """Streams shard `shard_id`'s `tensor` (its master values unless told otherwise) in
        `dtype` into `out` (a byte view of exactly the shard's size in that dtype); returns
        the version received."""
        request = ps_pb2.PullRequest(
            model=model, shard_id=shard_id, min_version=min_version, tensor=tensor, dtype=dtype
        )
        chunks = self._pull(request, timeout=timeout)
        return read_pull_stream(chunks, out, what=f"shard {shard_id} from daemon {self.address}", dtype=dtype)

    def push(self, push: Push, *, timeout: float) -> ps_pb2.PushResponse:
        """Streams the push's payload in chunks, the header with the first."""
        return self._push(push.chunks(), timeout=timeout)

    def prefetch(self, model: str, shard_ids: list[int], *, timeout: float) -> int:
        return self._prefetch(ps_pb2.PrefetchRequest(model=model, shard_ids=shard_ids), timeout=timeout).accepted

    def close(self) -> None:
        self.channel.close()


class ShardedClient:
    """A model's plan over an ordered daemon list, and shard-level push/pull with retries."""

    def __init__(self, daemons: list[str], *, config: ClientConfig | None = None) -> None:
        check_daemon_list(daemons)
        self.daemons = list(daemons)
        self.config = config or ClientConfig()
        security = self.config.security
        self.clients = [
            DaemonClient(
                a,
                max_message_bytes=self.config.max_message_bytes,
                security=security,
                dead_peer_seconds=self.config.dead_peer_seconds,
            )
            for a in daemons
        ]
        self.model = ""
        self.plan: list[ShardSlice] = []
        self.created: list[bool] = []
        # The daemons with an NVMe tier: only their Prefetch hints can save a read.
        self.nvme_daemons: set[int] = set()
        # Per daemon, what carries pulls and pushes: its local endpoint when it is reachable
        # (the node's own daemon), else its data plane when it has one (and the config allows
        # them), else the gRPC client.
        self.transports: list[Transport] = list(self.clients)
        # Host memory shared with the node's daemons (their local transports): see shared_host_tensor.
        self.host_windows = HostWindows()

    def register(self, spec: ps_pb2.ModelSpec) -> list[ShardSlice]:
        """Registers on every daemon (the first resolves the shard size when the spec leaves
        it 0), checks each daemon's plan equals the one computed here, and returns it."""
        spec = _copy(spec)
        del spec.daemons[:]
        spec.daemons.extend(self.daemons)
        self.model = spec.model
        self.created = []
        for index, client in enumerate(self.clients):
            # Registration waits for a daemon that is down (it may be starting): said after a
            # moment, not only once the first attempt's deadline (30 s) has passed.
            waiting = threading.Timer(UNREACHABLE_AFTER, self._say_unanswered, (index,))
            waiting.daemon = True
            waiting.start()
            try:
                response = self._call(
                    f"RegisterModel {spec.model!r}",
                    index,
                    lambda c=client, i=index: c.register(spec, i, timeout=self.config.register_timeout_seconds),
                )
            finally:
                waiting.cancel()
            if index == 0:
                spec.shard_bytes = response.shard_bytes
                self.plan = expected_plan(spec, response.shard_bytes)
                self._spec = spec
            check_protocol(self.daemons[index], response)
            got = [ShardSlice(s.shard_id, s.daemon_index, s.offset, s.numel) for s in response.shards]
            if got != self.plan:
                raise RuntimeError(
                    f"daemon {self.daemons[index]} computed a different shard plan for {spec.model!r}; "
                    "are all daemons and trainers running the same ps-offload version?"
                )
            self.created.append(response.created)
            if response.nvme_tier:
                self.nvme_daemons.add(index)
            else:
                self.nvme_daemons.discard(index)
            self._use_data_plane(index, response)
        return self.plan

    def _say_unanswered(self, index: int) -> None:
        wait = self.config.register_timeout_seconds + self.config.retry_seconds
        log.warning(
            "daemon %s does not answer (is it running, and is %s its server.listen?); waiting up to %.0f s for it "
            "(ClientConfig.register_timeout_seconds + retry_seconds)",
            self.daemons[index], self.daemons[index], wait,
        )  # fmt: skip

    def _use_data_plane(self, index: int, response: ps_pb2.RegisterModelResponse) -> None:
        current, data_port, endpoint = self.transports[index], response.data_port, response.local_endpoint
        if not data_port or self.config.transport == "grpc":
            return
        if endpoint and self.config.transport in ("auto", "local"):
            # The slot holds any push or pull of this daemon's largest shard.
            slot_bytes = slot_bytes_for(max((s.numel for s in self.plan if s.daemon_index == index), default=1))
            if isinstance(current, LocalClient) and (current.endpoint, current.slot_bytes) == (endpoint, slot_bytes):
                return
            local = self._connect_local(index, endpoint, slot_bytes)
            if local is not None:
                self._replace(index, local)
                return
        if isinstance(current, DataPlaneClient) and current.address[1] == data_port:
            return
        host, _ = split_host_port(self.daemons[index])
        self._replace(
            index,
            DataPlaneClient(
                host,
                data_port,
                max_connections=self.config.streams_per_daemon,
                security=self.config.security,
                dead_peer_seconds=self.config.dead_peer_seconds,
            ),
        )

    def _connect_local(self, index: int, endpoint: str, slot_bytes: int) -> LocalClient | None:
        """A client of the daemon's local endpoint if this process can reach it (the same host,
        network namespace and uid), else None: the data plane carries the bytes."""
        try:
            return LocalClient(
                endpoint,
                slot_bytes=slot_bytes,
                max_connections=self.config.streams_per_daemon,
                security=self.config.security,
                windows=self.host_windows,
            )
        except DataPlaneError as error:
            log.info("daemon %s: local transport not usable, using its data plane: %s", self.daemons[index], error)
            return None

    def _replace(self, index: int, transport: Transport) -> None:
        current = self.transports[index]
        if current not in self.clients:
            current.close()
        self.transports[index] = transport

    @property
    def local(self) -> bool:
        """Whether a daemon of this model is reached through the local transport."""
        return any(isinstance(t, LocalClient) for t in self.transports)

    def shared_host_tensor(self, numel: int, dtype: torch.dtype, prepare: Prepare | None = None) -> torch.Tensor | None:
        """A zeroed host tensor the node's daemon writes pulls into and reads pushes from where
        they lie (ps_offload.trainer.wire.host_windows); None without a local transport, or
        when the node's pool (server.local_pool_bytes) has no room: the caller allocates its
        own, and its bytes go through a copy. `prepare`: as HostWindows.allocate's."""
        if not self.local:
            return None
        return self.host_windows.allocate(numel, dtype, prepare)

    def _rediscover(self, index: int) -> None:
        """After the data plane became unreachable: ask the daemon again (RegisterModel is
        idempotent, and a restarted daemon has recovered the model), for its data port may
        have changed. Failures are left to the next attempt."""
        try:
            response = self.clients[index].register(self._spec, index, timeout=2.0)
        except grpc.RpcError:
            return
        self._use_data_plane(index, response)

    def _call(self, what: str, daemon_index: int, fn: Callable[[], T], retryable: frozenset = PUSH_RETRYABLE) -> T:
        """Runs fn with retries on transient errors; raises DaemonError otherwise."""
        address = self.daemons[daemon_index]
        delay = self.config.backoff_seconds
        give_up_at: float | None = None  # retry_seconds after the first transient error
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except grpc.RpcError as error:
                now = time.monotonic()
                give_up_at = give_up_at if give_up_at is not None else now + self.config.retry_seconds
                if (error.code() not in retryable and not busy(error)) or now >= give_up_at:
                    raise DaemonError(address, what, error) from None
                log.warning("%s on %s: %s (attempt %d), retrying", what, address, error.code().name, attempt)
                if isinstance(error, DataPlaneError) and error.code() == grpc.StatusCode.UNAVAILABLE and self.plan:
                    self._rediscover(daemon_index)
            time.sleep(max(0.0, min(delay, give_up_at - time.monotonic())))
            delay = min(delay * 2, 2.0)

    def send(self, shard: ShardSlice, data: memoryview, **header) -> ps_pb2.PushResponse:
        """Pushes `data` to this model's `shard`; `header`: the rest of the push's fields, as
        Push.build takes them (step and kind at least)."""
        return self.push(shard, Push.build(self.model, shard.shard_id, data, **header))

    def push(self, shard: ShardSlice, push: Push) -> ps_pb2.PushResponse:
        """Sends one shard's push (retried as a whole, the same bytes each attempt)."""
        header = push.header
        if (header.model, header.shard_id) != (self.model, shard.shard_id):
            raise ValueError(
                f"a push for {header.model!r} shard {header.shard_id} sent as shard {shard.shard_id} of {self.model!r}"
            )
        return self._call(
            push.describe(),
            shard.daemon_index,
            lambda: self.transports[shard.daemon_index].push(push, timeout=self.config.rpc_timeout_seconds),
        )

    def pull(
        self,
        shard: ShardSlice,
        *,
        min_version: int,
        out: memoryview,
        tensor: int = ps_pb2.MASTER,
        dtype: int = ps_pb2.FLOAT32,
    ) -> int:
        """Pulls the shard's `tensor` (master values by default) in `dtype` into `out`;
        returns its version."""
        what = "" if tensor == ps_pb2.MASTER else f" {ps_pb2.ShardTensor.Name(tensor)}"
        return self._call(
            f"pull of shard {shard.shard_id}{what} (version >= {min_version})",
            shard.daemon_index,
            lambda: self.transports[shard.daemon_index].pull_into(
                self.model,
                shard.shard_id,
                min_version=min_version,
                out=out,
                timeout=self.config.rpc_timeout_seconds,
                tensor=tensor,
                dtype=dtype,
            ),
            PULL_RETRYABLE,
        )

    def _by_daemon(self, shard_ids: list[int]) -> list[tuple[int, DaemonClient, list[int]]]:
        """(daemon index, client, its shards in the given order) for daemons with any."""
        groups = [(i, c, [s for s in shard_ids if self.plan[s].daemon_index == i]) for i, c in enumerate(self.clients)]
        return [group for group in groups if group[2]]

    def prefetch(self, shard_ids: list[int]) -> None:
        """Sends each daemon the hint for its shards, in the given order."""
        for index, client, mine in self._by_daemon(shard_ids):
            self._call("prefetch", index, lambda c=client, m=mine: c.prefetch(self.model, m, timeout=5.0))

    def hint(self, shard_ids: list[int]) -> None:
        """Like prefetch, but once, without raising, and only to daemons with an NVMe tier
        (on a RAM-only one it would be a call on each side for nothing): a lost hint costs
        only its speed-up, and a daemon that is down is for the next push to find (and retry)."""
        for index, client, mine in self._by_daemon(shard_ids):
            if index not in self.nvme_daemons:
                continue
            try:
                client.prefetch(self.model, mine, timeout=5.0)
            except grpc.RpcError as error:
                log.debug("prefetch hint to %s failed: %s", self.daemons[index], error.code().name)

    def close(self) -> None:
        for transport in self.transports:
            if transport not in self.clients:
                transport.close()
        for client in self.clients:
            client.close()


def expected_plan(spec: ps_pb2.ModelSpec, shard_bytes: int) -> list[ShardSlice]:
    """The plan every daemon must answer with (ps_daemon/store/shard_store.py computes the same)."""
    layouts = layout_params([(p.name, tuple(p.shape), None) for p in spec.params])
    total = sum(layout.numel for layout in layouts)
    starts = shard_starts(layouts, [p.starts_shard for p in spec.params])
    return plan_shards(total, shard_numel_for(shard_bytes), len(spec.daemons), starts)


def _copy(spec: ps_pb2.ModelSpec) -> ps_pb2.ModelSpec:
    out = ps_pb2.ModelSpec()
    out.CopyFrom(spec)
    return out
