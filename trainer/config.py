"""What a training script configures: the optimizer the daemons run, and how the client
talks to them. One dataclass per concern; every field says what it is."""

from __future__ import annotations

from dataclasses import dataclass, field

from ps_offload.proto import ps_pb2
from ps_offload.proto.security import ClientSecurity


@dataclass(frozen=True)
class AdamW:
    """AdamW as torch.optim.AdamW defines it, run on the daemons."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def to_proto(self) -> ps_pb2.OptimizerSpec:
        return ps_pb2.OptimizerSpec(
            adamw=ps_pb2.AdamWSpec(
                lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay
            )
        )


@dataclass(frozen=True)
class SGD:
    """SGD with momentum as torch.optim.SGD defines it, run on the daemons."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def to_proto(self) -> ps_pb2.OptimizerSpec:
        return ps_pb2.OptimizerSpec(
            sgd=ps_pb2.SGDSpec(
                lr=self.lr,
                momentum=self.momentum,
                dampening=self.dampening,
                weight_decay=self.weight_decay,
                nesterov=self.nesterov,
            )
        )


@dataclass(frozen=True)
class ClientConfig:
    """How the trainer talks to the daemons."""

    rpc_timeout_seconds: float = 60.0
    """Deadline of one push or pull attempt, including the wait for a version."""
    register_timeout_seconds: float = 30.0
    """Deadline of RegisterModel, which also covers waiting for a daemon to come up."""
    max_attempts: int = 8
    """Attempts per call on transient errors (see trainer/client.py); with the backoff
    below they span about 7 s, long enough for a daemon restarted by systemd to recover and
    answer. Retrying is safe: pushes are idempotent on (shard, step), pulls only read."""
    backoff_seconds: float = 0.1
    """First retry delay; doubles per attempt, capped at 2 s."""
    transport: str = "auto"
    """"auto": pulls and pushes go over a daemon's TCP data plane when it offers one, else
    over gRPC; "grpc": always over gRPC (the Pull and Push RPCs)."""
    streams_per_daemon: int = 2
    """Concurrent push/pull calls per daemon."""
    prefetch_hints: bool = True
    """After each step's pulls, tell every daemon which of its shards the next step pushes
    first (all of them, in push order; the daemon loads as many as its RAM tier has room
    for), so that a daemon whose state exceeds RAM reads them during the forward and
    backward passes instead of when the pushes arrive."""
    max_message_bytes: int = 8 << 20
    """Largest gRPC message either side accepts; chunks are far smaller."""
    security: ClientSecurity = field(default_factory=ClientSecurity)
    """TLS (the CA that signed the daemons' certificates, a client certificate for mutual
    TLS) and the bearer token file, for daemons configured with [tls] and [auth]. The
    default connects in plaintext without a token."""

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "grpc"):
            raise ValueError(f'ClientConfig.transport must be "auto" or "grpc", got {self.transport!r}')
        if self.max_attempts < 1 or self.streams_per_daemon < 1:
            raise ValueError("ClientConfig.max_attempts and streams_per_daemon must be at least 1")
