"""What a training script configures, one dataclass per concern; every field says what it is.

    AdamW, SGD, LAMB, Adafactor   the optimizer (ps_offload.optimizers: run by the daemons;
                         all but LAMB also in-process without them)
    OffloadConfig        how a model is registered with the daemons and stepped through them
    DeviceConfig         how shards move between the trainer's device and the wire
    LossScaling          dynamic loss scaling for float16 parameters
    CompressionConfig    how gradients travel: pushes to the daemons, or the dp all-reduce
    ParallelConfig       pipeline stages x data-parallel replicas (PipelineTrainer)
    ClientConfig         how the trainer talks to the daemons (timeouts, retries, transport, TLS)

They hold data only (what a TOML file could say); callables (`no_weight_decay`,
`reduce_hook`) stay keyword arguments of the objects that run them. Each checks itself in
`__post_init__`, so a bad value fails where it is written, before a daemon is called.
tests/trainer/test_config.py freezes the set of fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The optimizers' configs live with their plug-ins; re-exported as the trainer's config.
from ps_offload.optimizers import LAMB as LAMB
from ps_offload.optimizers import SGD as SGD
from ps_offload.optimizers import Adafactor as Adafactor
from ps_offload.optimizers import AdamW as AdamW
from ps_offload.optimizers import OptimizerConfig as OptimizerConfig
from ps_offload.proto.security import ClientSecurity

STATE_DTYPES = ("float32", "bfloat16")  # OffloadConfig.state_dtype (the daemon's ModelSpec.state_dtype)
COMPRESSION_METHODS = ("none", "bf16", "fp16", "onebit", "topk")
SCHEDULES = ("gpipe", "1f1b")
SPLITS = ("params", "uniform")


@dataclass(frozen=True)
class OffloadConfig:
    """How a model is registered with the daemons and stepped through them (`offload()`,
    `OffloadOptimizer`, each stage of a `PipelineTrainer`)."""

    model_name: str = "model"
    """The model's name on the daemons. Registering the same name and spec again resumes
    from the daemons' state. A PipelineTrainer registers each stage as `<model_name>.stage<i>`."""
    shard_bytes: int = 0
    """fp32 bytes per shard, rounded down to whole 4 KiB pages; 0 takes the first daemon's
    default (`store.shard_bytes`)."""
    staleness: int = 0
    """0: each step computes on the parameters the step before produced. 1: the delayed
    parameter update (ZeRO-Offload's DPU): step() returns once the gradients are handed
    over, and the next step computes on the parameters it already has while the daemons
    apply this one (one step of gradient staleness; a second copy of the parameters and
    gradients on the trainer)."""
    push_share: tuple[int, int] = (0, 1)
    """(i, n): this process pushes every n-th shard from the i-th and only pulls the others,
    so n processes holding the same reduced gradients (the data-parallel replicas of one
    stage) push each shard once between them. PipelineTrainer sets it from the grid."""
    push_in_backward: bool = False
    """Push each shard's gradient as soon as backward has finished all of it, overlapping the
    rest of backward; step() then only applies it (trainer/offload/backward_push.py). A gradient
    changed after backward (clip_grad_norm_) or a second backward before step() is noticed,
    and step() sends the whole gradient again: the result is the same either way. offload()
    only, with staleness=0 and no compression."""
    audit_every: int = 0
    """Every this many steps, check one shard's update against torch.optim (trainer/offload/audit.py):
    its state is pulled before and after the step, the step is recomputed in process by
    torch.optim.AdamW(fused=True) or SGD(fused=True) on the same gradient and settings, and a
    difference raises ps_offload.AuditMismatch. Shards are taken in turn; `opt.audit.stats`
    counts the audits. 0: off. With staleness=0 and no compression; offload() and unstreamed
    PipelineTrainer stages (a streamed model is not audited yet). Costs one shard's state
    pulled twice and stepped once per audit."""
    audit_tolerance: float = 0.0
    """The largest |difference| an audit lets pass, per element of the master and of each state
    tensor. 0: bit for bit, what a CPU daemon running the trainer's torch build gives. Raise it
    for daemons whose CPU takes other kernel paths (another instruction set or torch build)."""
    replicas: int = 1
    """Daemons holding each shard (at most as many as the list has). With 2 or more, every push
    goes to each live holder of its shard, which apply it alike (their kernels are checked to
    round alike at registration), pulls come from the first live one, and training goes on
    while any replicas - 1 of a shard's holders are lost: a holder that stops answering for
    `ClientConfig.dead_peer_seconds` is left out for the rest of the run, with a WARNING naming
    the shards it leaves short. Replica j of a shard sits num_daemons / replicas places after
    its primary in the daemon list, so a list written node by node puts them on other nodes."""

    state_dtype: str = "float32"
    """What the daemons keep master values and optimizer state in. "float32" (the default):
    fp32 master, m and v (12 bytes a parameter with AdamW) whatever the model's dtype, bit for
    bit with torch.optim on an fp32 copy of the model. "bfloat16", for a bf16 model: master, m
    and v in bf16 (6 bytes a parameter, half the bytes every step moves, holds and writes to
    NVMe), bit for bit with torch.optim.AdamW(fused=True) on the bf16 parameters themselves,
    what torchao's CPU offload keeps for a bf16 model. AdamW only. What it trades:
    an update smaller than half a bf16 ulp of a weight rounds away (with lr 1e-4, a weight
    near 1 stops moving), and m and v carry 8 bits of mantissa, so long runs at small learning
    rates train worse than with fp32 master weights. Not with 1-bit Adam."""

    def __post_init__(self) -> None:
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"OffloadConfig.state_dtype must be one of {', '.join(map(repr, STATE_DTYPES))}, "
                f"got {self.state_dtype!r}"
            )
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"OffloadConfig.model_name must be a non-empty string, got {self.model_name!r}")
        size = self.shard_bytes
        if isinstance(size, bool) or not isinstance(size, int) or not (size == 0 or size >= 4096):
            raise ValueError(  # (the daemons refuse less than 4 KiB; said here, before any work)
                f"OffloadConfig.shard_bytes must be an int, 0 (the daemon's default) or at least 4096, got {size!r}"
            )
        if self.staleness not in (0, 1):
            raise ValueError(
                f"OffloadConfig.staleness must be 0 (exact update) or 1 (delayed update), got {self.staleness!r}"
            )
        if len(self.push_share) != 2 or not 0 <= self.push_share[0] < self.push_share[1]:
            raise ValueError(f"OffloadConfig.push_share must be (i, n) with 0 <= i < n, got {self.push_share!r}")
        if self.push_in_backward and self.staleness:
            raise ValueError(
                "OffloadConfig.push_in_backward needs staleness=0 (the delayed update pushes after backward)"
            )
        replicas = self.replicas
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"OffloadConfig.replicas must be an int >= 1, got {replicas!r}")
        every = self.audit_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"OffloadConfig.audit_every must be an int >= 0 (0: off), got {every!r}")
        tolerance = self.audit_tolerance
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
            raise ValueError(f"OffloadConfig.audit_tolerance must be a finite number >= 0, got {tolerance!r}")
        if every and self.staleness:
            raise ValueError(
                "OffloadConfig.audit_every needs staleness=0: under the delayed update the step's state is not "
                "pulled before its push"
            )


@dataclass(frozen=True)
class DeviceConfig:
    """How shards move between the trainer's device and the wire (trainer/io/device.py)."""

    host_buffers: int = 4
    """Host buffers of one shard each (in the compute dtype) that carry pushes and pulls
    between an accelerator and the wire, at most this many shards in flight. They are pinned
    memory, so this bounds it: host_buffers x the largest shard's bytes in the compute dtype,
    checked against `max_pinned_bytes` at start; it also caps the transfers run at once (so
    none waits for a buffer while holding one of the I/O threads). Not used on the CPU unless
    staging="always"."""
    staging: str = "auto"
    """"auto": a CPU model pushes and pulls its own buffers in place, an accelerator's go
    through the host buffers; "always": through the host buffers on the CPU too (the
    accelerator's path, without one)."""
    max_pinned_bytes: int | None = None
    """The most bytes the host buffers may take (pinned on an accelerator, which the kernel
    cannot page out). None: a quarter of the host's MemAvailable (/proc/meminfo) at start.
    Either way a start that needs more, or more than MemAvailable, fails with what to change.
    (CUDA's pinned memory is not charged to RLIMIT_MEMLOCK: that limit is only logged.)"""

    def __post_init__(self) -> None:
        if isinstance(self.host_buffers, bool) or not isinstance(self.host_buffers, int) or self.host_buffers < 1:
            raise ValueError(f"DeviceConfig.host_buffers must be an int >= 1, got {self.host_buffers!r}")
        if self.staging not in ("auto", "always"):
            raise ValueError(f'DeviceConfig.staging must be "auto" or "always", got {self.staging!r}')
        budget = self.max_pinned_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"DeviceConfig.max_pinned_bytes must be None or an int >= 1, got {budget!r}")


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling for float16 parameters, by torch.amp.GradScaler's rules: the loss
    is multiplied by `scale` before backward (`opt.scale_loss(loss)`); a step whose gradients
    hold an inf or a NaN on any rank is skipped everywhere and the scale shrinks; after
    `growth_interval` good steps in a row it grows. The daemons unscale in fp32."""

    init_scale: float = 2.0**16
    """The first scale."""
    growth_factor: float = 2.0
    """The scale is multiplied by this after `growth_interval` steps without an overflow."""
    backoff_factor: float = 0.5
    """And by this after a step with one."""
    growth_interval: int = 2000
    """Good steps in a row before the scale grows."""

    def __post_init__(self) -> None:
        if not (0 < self.init_scale < float("inf")):
            raise ValueError(f"LossScaling.init_scale must be finite and > 0, got {self.init_scale!r}")
        if not self.growth_factor > 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"LossScaling needs growth_factor > 1 and 0 < backoff_factor < 1, got {self.growth_factor!r} "
                f"and {self.backoff_factor!r}"
            )
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            raise ValueError(f"LossScaling.growth_interval must be an int >= 1, got {self.growth_interval!r}")
        if self.growth_interval < 1:
            raise ValueError(f"LossScaling.growth_interval must be an int >= 1, got {self.growth_interval!r}")


@dataclass(frozen=True)
class CompressionConfig:
    """How gradients travel, with error feedback: a model's pushes to the daemons
    (`offload(compression=...)`), or a stage's data-parallel all-reduce
    (`ParallelConfig.dp_compression`). Everything but "none" keeps what it leaves out in an
    fp32 error buffer and sends it with later steps."""

    method: str = "none"
    """"none" (fp32), "bf16", "fp16", "onebit" (signs and a scale per 1024 elements, 1/32
    of fp32) or "topk" (the `topk_ratio` largest of every 1024 elements, with their
    indices). Pushes under AdamW with "onebit" are 1-bit Adam: the trainer compresses the
    momentum instead of the gradient and the daemons freeze the variance after the warm-up."""
    warmup_steps: int = 0
    """The first steps go uncompressed. 1-bit Adam needs at least one to estimate the
    variance, and trains best with 15-25% of the run."""
    topk_ratio: float = 0.01
    """The share of each 1024-element block that "topk" sends, 0 < ratio <= 1."""

    def __post_init__(self) -> None:
        if self.method not in COMPRESSION_METHODS:
            raise ValueError(
                f"CompressionConfig.method must be one of {', '.join(map(repr, COMPRESSION_METHODS))}, "
                f"got {self.method!r}"
            )
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"CompressionConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        ratio = self.topk_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"CompressionConfig.topk_ratio must be in (0, 1], got {ratio!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class ParallelConfig:
    """Pipeline stages x data-parallel replicas: how a PipelineTrainer splits the layers,
    schedules the micro-batches and reduces the gradients. The grid itself (pp, dp) comes
    from `init_distributed(pp=, dp=)`."""

    microbatches: int = 1
    """Micro-batches per step; each replica's batch is split into this many. 1F1B needs at
    least as many as there are stages."""
    schedule: str = "1f1b"
    """"1f1b" (one forward, one backward: at most pp - s micro-batches of activations on
    stage s) or "gpipe" (all forwards, then all backwards). Checked when the trainer is
    built (trainer/pipeline/schedule_check.py)."""
    split: str = "params"
    """How layers are cut into stages: "params" (the largest stage has the fewest
    parameters) or "uniform" (layer counts as equal as possible)."""
    bucket_bytes: int = 25 << 20
    """Gradient bytes per data-parallel all-reduce bucket; buckets start during backward."""
    first_bucket_bytes: int = 1 << 20
    """The first bucket (the last layers' gradients) is smaller, so the network starts early."""
    max_grad_norm: float | None = None
    """Clip the whole model's gradient norm (over every stage) to this; None: no clipping."""
    dp_compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Compression of the data-parallel all-reduce, both ways (trainer/pipeline/compressed_allreduce.py),
    after `warmup_steps` plain steps."""

    def __post_init__(self) -> None:
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"ParallelConfig.microbatches must be an int >= 1, got {self.microbatches!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ParallelConfig.schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.split not in SPLITS:
            raise ValueError(f"ParallelConfig.split must be one of {list(SPLITS)}, got {self.split!r}")
        if self.bucket_bytes < 1 or self.first_bucket_bytes < 1:
            raise ValueError(
                f"ParallelConfig.bucket_bytes and first_bucket_bytes must be >= 1, "
                f"got {self.bucket_bytes} and {self.first_bucket_bytes}"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"ParallelConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if not isinstance(self.dp_compression, CompressionConfig):
            raise TypeError(
                f"ParallelConfig.dp_compression takes a CompressionConfig, e.g. "
                f'CompressionConfig(method="onebit", warmup_steps=100); got {self.dp_compression!r}'
            )
        if self.dp_compression.warmup_steps and not self.dp_compression.enabled:
            raise ValueError(
                "ParallelConfig.dp_compression.warmup_steps counts the plain steps before dp_compression "
                "starts; it needs a dp_compression other than none"
            )


def expect_config(value: object, cls: type, argument: str) -> object:
    """`value`, or `cls()` for None; a TypeError naming the argument for anything else (the
    keyword arguments these configs replaced took strings, numbers and ClientConfig)."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{argument}= takes {cls.__name__}(...), got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class ClientConfig:
    """How the trainer talks to the daemons."""

    rpc_timeout_seconds: float = 60.0
    """Deadline of one push or pull attempt, including the wait for a version."""
    register_timeout_seconds: float = 30.0
    """Deadline of RegisterModel, which also covers waiting for a daemon to come up."""
    retry_seconds: float = 60.0
    """How long a call keeps retrying after transient errors (see trainer/wire/sharded_client.py) before
    it fails: a time, not a count, so it covers a daemon's restart however many attempts
    that takes (1.5 to 7 s here; a daemon recovering a large NVMe tier takes longer).
    Retrying is safe: pushes are idempotent on (shard, step), pulls only read. 0: no retry."""
    dead_peer_seconds: float = 10.0
    """A call to a daemon that stops answering without closing the connection (a network
    partition, a host gone) fails and is retried after about this long, not after
    rpc_timeout_seconds: gRPC keepalive pings and TCP keepalive on the data plane. A daemon
    gone for good so fails the job within about dead_peer_seconds + retry_seconds."""
    backoff_seconds: float = 0.1
    """First retry delay; doubles per attempt, capped at 2 s (and at what is left of
    retry_seconds)."""
    transport: str = "auto"
    """Per daemon, what carries pulls and pushes. "auto": shared memory when the daemon is on
    this host and this process can reach its local endpoint (same network namespace, and the
    daemon's uid or its server.local_group: proven by connecting, not assumed), else its TCP
    data plane when it offers one, else gRPC; "local": the same as "auto" (the name of the last
    release's opt-in); "tcp": the data plane (else gRPC), never shared memory; "grpc": always
    gRPC (the Pull and Push RPCs)."""
    streams_per_daemon: int = 2
    """Concurrent push/pull calls per daemon, for each of a trainer's pools: pulls and pushes run
    on pools of their own (a streamed model's prefetching pulls beside its backward's pushes),
    so a daemon sees up to twice this at once, and the trainer keeps that many connections to
    it open (`connections_per_daemon`)."""
    prefetch_hints: bool = True
    """After each step's pulls, tell every daemon which of its shards the next step pushes
    first (all of them, in push order; the daemon loads as many as its RAM tier has room
    for), so that a daemon whose state exceeds RAM reads them during the forward and
    backward passes instead of when the pushes arrive."""
    max_message_bytes: int = 8 << 20
    """Largest gRPC message either side accepts; chunks are far smaller."""
    security: ClientSecurity = field(default_factory=ClientSecurity.from_environment)
    """TLS (the CA that signed the daemons' certificates, a client certificate for mutual
    TLS) and the bearer token file, for daemons configured with [tls] and [auth]. The
    default reads the environment ps-admin reads ($PS_TLS_CA_FILE, $PS_TOKEN_FILE, ...:
    ClientSecurity.from_environment); with none of it set, plaintext without a token."""

    @property
    def connections_per_daemon(self) -> int:
        """Connections to one daemon's data plane or local endpoint kept open between calls:
        as many as the trainer makes at once, `streams_per_daemon` pulls beside as many pushes.
        Fewer, and every burst of pulls beside pushes closed some at release to open them again
        moments later (a thread, a session and a slot on the daemon each; docs/benchmarks.md,
        stream_overhead)."""
        return 2 * self.streams_per_daemon

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "local", "tcp", "grpc"):
            raise ValueError(f'ClientConfig.transport must be "auto", "local", "tcp" or "grpc", got {self.transport!r}')
        if self.streams_per_daemon < 1:
            raise ValueError("ClientConfig.streams_per_daemon must be at least 1")
        if isinstance(self.dead_peer_seconds, bool) or not 1 <= self.dead_peer_seconds <= 3600:
            raise ValueError(f"ClientConfig.dead_peer_seconds must be in [1, 3600], got {self.dead_peer_seconds!r}")
        for name in ("retry_seconds", "backoff_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"ClientConfig.{name} must be a finite number of seconds >= 0, got {value!r}")
