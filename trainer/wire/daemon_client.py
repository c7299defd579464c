"""One daemon's channel and its data-path methods (`DaemonClient`), and what a caller of
them needs to tell errors apart: `DaemonError`, which codes are retried, a busy refusal, a
daemon too old for this trainer. `ShardedClient` (sharded_client.py) moves a model's shards
over one of these per daemon."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2

from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.channel import (
    BUSY_METADATA,
    MIN_DAEMON_PROTOCOL,
    channel_options,
    keepalive_options,
    method_path,
)
from ps_offload.proto.memory import keep_chunk_buffers_in_heap
from ps_offload.proto.pull import Pull, read_pull_stream
from ps_offload.proto.push import Push
from ps_offload.proto.security import ClientSecurity
from ps_offload.trainer.wire.transport import PullInto
from ps_offload.version import release as ps_offload_release

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


def check_state_dtype_echo(address: str, spec: ps_pb2.ModelSpec, response: ps_pb2.RegisterModelResponse) -> None:
    """Refuses a daemon that keeps the model in another state dtype than the spec asks: one
    from before ModelSpec.state_dtype ignores the field and would keep fp32 state, training
    something else than the trainer was told (its response then says DTYPE_UNSPECIFIED)."""
    wanted = spec.state_dtype or ps_pb2.FLOAT32
    kept = response.state_dtype or ps_pb2.FLOAT32
    if wanted != kept:
        release = response.daemon_version or "a release from before 0.1.0"
        raise RuntimeError(
            f"daemon {address} ({release}) keeps model {spec.model!r} in {ps_pb2.DType.Name(kept)} state, the trainer "
            f"asked for {ps_pb2.DType.Name(wanted)} (OffloadConfig.state_dtype): upgrade the daemons; the model "
            "was registered there, so drop it (ps-admin drop) before training it again"
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
        self._health = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
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

    def pull_into(self, pull: Pull, *, out: memoryview, timeout: float) -> int:
        """Streams what `pull` asks for into `out` (a byte view of exactly the shard's size in its
        dtype); returns the version received."""
        chunks = self._pull(pull.request, timeout=timeout)
        what = f"shard {pull.shard_id} from daemon {self.address}"
        return read_pull_stream(chunks, out, what=what, dtype=pull.dtype)

    def serving(self, *, timeout: float) -> bool:
        """Whether the daemon answers a health check SERVING within `timeout` (it is up, if busy)."""
        try:
            answer = self._health(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def push(self, push: Push, *, timeout: float, pull_into: PullInto | None = None) -> ps_pb2.PushResponse:
        """Streams the push's payload in chunks, the header with the first (`pull_into`: not
        over gRPC; the answer's `pulled` stays false)."""
        return self._push(push.chunks(), timeout=timeout)

    def prefetch(self, model: str, shard_ids: list[int], *, timeout: float) -> int:
        return self._prefetch(ps_pb2.PrefetchRequest(model=model, shard_ids=shard_ids), timeout=timeout).accepted

    def close(self) -> None:
        self.channel.close()
