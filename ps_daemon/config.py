"""Daemon configuration: one dataclass per concern, loaded from TOML.

The loader rejects unknown keys (a typo must not silently become a default) and warns on
keys that were renamed, naming the new key. Sizes accept integers or strings with binary
units ("64MiB").
"""

from __future__ import annotations

import dataclasses
import difflib
import grp
import ipaddress
import logging
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


class ConfigError(ValueError):
    """A configuration a person must fix; the message says what and where."""


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    """host:port of the gRPC port; port 0 picks a free one (the chosen port is logged and
    written to `port_file` when set)."""
    data_listen: str = "auto"
    """host:port of the TCP data plane that carries pulls and pushes without gRPC's copies;
    "auto": the host of `listen` on a free port; "off": pulls and pushes use gRPC only.
    The port is advertised to trainers in RegisterModel. It uses TLS exactly when
    the gRPC port does ([tls]), with the same certificate."""
    port_file: str = ""
    """If set, the bound port is written here once the server listens (tests, demos)."""
    max_data_connections: int = 4096
    """Data plane connections open at once (a descriptor each, not a thread: the systemd unit's
    LimitNOFILE must exceed it); one more is answered RESOURCE_EXHAUSTED and closed. They bound
    the data plane's waiting pulls too: a connection carries one request at a time."""
    max_data_connections_per_client: int = 256
    """Data plane connections open at once from one address (every rank on that host shares
    them); one more is answered RESOURCE_EXHAUSTED and closed. The local transport's
    connections (the ranks on this host) are bounded by it too: they hold a thread each."""
    local_pool_bytes: int = 0
    """The node's pool of host memory its own ranks share with it (the local transport's
    windows: their parameter, gradient and staging buffers, page-locked on a GPU host). A
    window past it is refused, and that rank moves its bytes through a copy instead. 0: a
    quarter of the host's MemAvailable at start; a value above MemAvailable refuses to start."""
    data_workers: int = 64
    """Threads serving data plane requests. A pull waiting for a version holds none."""
    data_idle_seconds: float = 300.0
    """A data plane connection with no next request (or a request or TLS handshake stalled
    half-sent) for this long is closed; trainers reconnect unseen."""
    data_stall_seconds: float = 30.0
    """A data plane request or gRPC call whose request or answer stops moving for this long
    is cut off, freeing its worker or thread (a client that stopped reading or writing
    midway, or never sent its request)."""
    max_workers: int = 32
    """Threads serving RPCs. Pulls waiting for a version hold one each."""
    max_calls_per_client: int = 0
    """Most gRPC calls from one client address running at once (every process on that host
    shares them); one more is answered RESOURCE_EXHAUSTED, marked busy, which trainers retry.
    0: half of max_workers, so that one host cannot hold every thread. A call whose client
    stops sending or reading for data_stall_seconds is cut off (ps_daemon/rpc/call_bounds.py)."""
    max_waiting_pulls: int = 0
    """Most gRPC Pulls waiting at once for a version not pushed yet; one more is answered
    RESOURCE_EXHAUSTED (ps_daemon/store/pull_wait.py). 0: half of max_workers, so the other half
    serves pushes, admin calls and health checks whatever the pulls do."""
    max_waiting_pulls_per_client: int = 0
    """Most of those from one client address (every process on that host shares them); one
    more is answered RESOURCE_EXHAUSTED. 0: half of max_waiting_pulls."""
    max_message_bytes: int = 8 << 20
    """Largest single gRPC message accepted or sent; larger ones get RESOURCE_EXHAUSTED.
    Bulk data is streamed in chunks well below this."""
    grace_seconds: float = 30.0
    """On SIGTERM, in-flight RPCs get this long to finish before they are cancelled."""
    max_pull_wait_seconds: float = 600.0
    """Longest a Pull waits for `min_version` when the caller set no deadline."""
    health_listen: str = ""
    """host:port of a plaintext port that serves grpc.health.v1 alone, for probes that cannot
    speak TLS (the kubelet's gRPC probes). It answers what a check through the main server
    answers, tried every health_check_seconds: a hung server reads NOT_SERVING there too.
    Empty: none (the main port's Health service, under its TLS, is enough)."""
    health_check_seconds: float = 10.0
    """How often the daemon checks itself through its main server for health_listen."""
    local_group: str = ""
    """A group whose members may use the local shared-memory transport besides the daemon's own
    uid: the trainers' users, when the daemon runs as a user of its own (the systemd units'
    ps-daemon; systemd/README.md creates the group ps-offload). Empty: the daemon's uid only.
    Its members hand the daemon their memory and read what it writes there: trust them as
    you trust the daemon's user. A group this host does not know refuses to start."""
    cpus: str = ""
    """The CPUs every thread of the daemon runs on, as a list such as "0-7,16" (the format of
    taskset -c and systemd's CPUAffinity=): on a host shared with trainers, the rest are
    theirs. Empty: those it was started with (its cgroup's cpuset, CPUAffinity=, taskset). A
    CPU it may not run on refuses to start."""
    scheduling: str = "normal"
    """How the daemon's threads share their CPUs with the rest of the host. "normal": as any
    process does. "idle": every thread at Linux's SCHED_IDLE (systemd's CPUSchedulingPolicy=idle),
    so a core runs the daemon only when no other thread wants it. For a daemon on the cores of
    the compute it serves (a CPU trainer on a small host): a trainer's torch ops run on all its
    cores and each waits for its slowest thread, so the daemon taking one of them mid-op can
    stall the whole op, while the time the trainer waits on the daemon hands it the cores
    (measured: stream_overhead's idle_daemon_step_ratio, docs/benchmarks.md). Not where other
    work keeps every core busy: the daemon, its watchdog pings included, would then get almost
    none."""
    insecure: bool = False
    """Serve plaintext on an address other than loopback anyway (no [tls]: gradients,
    parameters and any token travel in clear). Without it such a daemon refuses to start;
    with it, it says so in a WARNING and in its systemd status at every start."""


@dataclass(frozen=True)
class StoreConfig:
    ram_bytes: int = 8 << 30
    """Budget of the RAM tier: master values plus optimizer state of resident shards.
    A registration that would exceed it is refused with RESOURCE_EXHAUSTED."""
    shard_bytes: int = 64 << 20
    """Default fp32 master bytes per shard, used when a trainer does not ask for a size.
    Rounded down to a multiple of 4 KiB."""
    nvme_dir: str = ""
    """Directory (on an NVMe drive) where every committed version of every shard is written
    with O_DIRECT before its push is acknowledged, and recovered from after a restart.
    Empty: RAM only, nothing survives a restart. It must exist (see create_nvme_dir) and
    belongs to one daemon: a second one on it refuses to start."""
    create_nvme_dir: bool = False
    """Create nvme_dir (and its parents) when it is missing. Off: a missing directory refuses
    to start, so that a typo or a disk that is not mounted is not an empty daemon whose
    trainers restart from step 0."""
    nvme_bytes: int = 0
    """Most bytes this daemon's arena files under nvme_dir may take together; a registration
    past it is refused with RESOURCE_EXHAUSTED. 0: as much as the disk has. A model takes
    (shards + spare slots) x (its largest shard's master and optimizer state + 4 KiB)."""
    nvme_spare_slots: int = 8
    """Slots per model beyond one per shard, holding versions while they are written (at
    most one per shard is used). More lets more commits run at once; each costs one shard's
    state on disk."""
    nvme_floor_seconds: float = 1.0
    """How often each model's committed versions are recorded beside its arena file, so that a
    shard whose newest slot header is later damaged is refused (DATA_LOSS) instead of coming
    back one version older. A version committed less than this before such damage is not
    covered."""
    fsync: bool = True
    """fdatasync between a shard's bytes and its header, and after the header, so that a
    committed version also survives a power loss (not only a crash of the daemon)."""
    io_threads: int = 4
    """Threads doing O_DIRECT writes (a commit's bytes are split over them)."""
    io_read_threads: int = 8
    """Threads doing O_DIRECT reads, a queue of their own (a read a pull waits for never
    queues behind write-back); a shard's read is split over them. Twice the writers: on the
    project's disk 8 MiB x 8 in flight read about 1.1x faster than x 4, writes no faster
    (bench/nvme_engines.py, nvme_io.py)."""
    optimizer_threads: int = 0
    """Threads of the optimizer's step (the daemon's AdamW / SGD, its non-finite check). 0: one
    per CPU the daemon runs on (server.cpus), less one per GPU of the host, so that each
    co-located GPU trainer rank keeps a core for its launches and copies (at least 1)."""
    io_block_bytes: int = 8 << 20
    """Size of one O_DIRECT read or write; rounded up to 4 KiB."""
    prefetch_depth: int = 2
    """With an NVMe tier: as each push arrives, read ahead this many of the shards not pushed
    yet this step, in the previous step's order (0: only the trainers' Prefetch hints)."""
    allow_nonfinite_pushes: bool = False
    """Apply a gradient or momentum push whose values hold a NaN or an infinity (an element, a
    TOPK value, a ONEBIT block scale), as torch would in process. Off: it is refused with
    INVALID_ARGUMENT naming the shard and the first such value, and nothing changes: on a
    shared daemon one trainer's NaN would otherwise poison the shard's state for good.
    Checking costs one read of the payload per push, as it came (docs/benchmarks.md, nonfinite_check)."""
    speculation_bytes: int = 2 << 30
    """Spare copies of shard state for steps computed while a trainer's backward still runs
    (OffloadConfig(push_in_backward=True)): each such shard holds a second copy of its master
    and optimizer state from its gradient's arrival until its APPLY, which adopts it, or
    discards it when a clip fired or the settings changed. Past this budget a shard's step waits
    for its APPLY, as with 0. To compute every shard during backward, set it to the state this
    daemon holds for the model (ps-admin stats: ram_bytes_used)."""
    max_models: int = 256
    """Models registered at once; one more is refused with RESOURCE_EXHAUSTED."""
    max_shards_per_model: int = 1 << 18
    """Shards one model's plan may have (all daemons' together), counted from its spec
    before the plan is built; more is refused with RESOURCE_EXHAUSTED (larger shards fit)."""


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str = ""
    """PEM certificate chain the gRPC port and the data plane present. Empty (with key_file
    empty): plaintext, for loopback and trusted networks only."""
    key_file: str = ""
    """PEM private key of cert_file. Read once at start; keep it readable by the daemon only."""
    client_ca_file: str = ""
    """PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS);
    one without a certificate, or with one from another CA, is refused in the handshake."""


@dataclass(frozen=True)
class AuthConfig:
    token_file: str = ""
    """File whose first line is the bearer token clients must send (gRPC metadata
    `authorization: Bearer <token>`). Never on the command line: it would show in `ps`.
    Re-read on SIGHUP. Empty: no token."""
    require_token: str = "admin"
    """Which calls need the token when token_file is set: "admin" (the Admin calls that
    change state: Evict, Load, DropModel, CreateSnapshot, DeleteSnapshot) or "all" (every
    call but health checks, including the data plane's pulls and pushes)."""


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = ""
    """host:port of the Prometheus endpoint (GET /metrics, plain HTTP); port 0 picks a free
    port. Empty: no metrics endpoint. Keep it on a management network: it is not behind TLS
    or the token."""
    port_file: str = ""
    """If set, the metrics port is written here once it listens (tests, demos)."""


@dataclass(frozen=True)
class LogConfig:
    level: str = "INFO"
    """Python logging level name."""
    format: str = "text"
    """"text": one line per record ("TIME LEVEL LOGGER: MESSAGE"; under journald, its
    priority first and no time). "json": one JSON object per line (time, level, logger,
    message, exception), for log shippers."""


@dataclass(frozen=True)
class DaemonConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log: LogConfig = field(default_factory=LogConfig)


# Keys that were renamed: old dotted key -> new dotted key. The old key still works, with a
# warning, so configs in the field keep running across an upgrade.
RENAMED_KEYS: dict[str, str] = {}
# Keys that are no longer read: old dotted key -> why. Accepted with a warning, so a config
# in the field keeps starting.
REMOVED_KEYS: dict[str, str] = {
    "store.state_dir": (
        "nothing was ever written there; a daemon's state lives under store.nvme_dir (empty: RAM only, "
        "every model is lost when the daemon stops)"
    ),
}

SCHEDULING = ("normal", "idle")
"""server.scheduling's values."""

_SIZE_FIELDS = {
    "max_message_bytes",
    "ram_bytes",
    "shard_bytes",
    "io_block_bytes",
    "nvme_bytes",
    "local_pool_bytes",
    "speculation_bytes",
}
_SECTIONS = {
    "server": ServerConfig,
    "store": StoreConfig,
    "tls": TlsConfig,
    "auth": AuthConfig,
    "metrics": MetricsConfig,
    "log": LogConfig,
}


def parse_size(value: Any, *, key: str) -> int:
    """Parses 4096, "4096", "64MiB", "8 GiB" into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?i?B?)\s*", value, re.IGNORECASE)
        unit = match.group(2).upper() if match else ""
        if not match or unit not in _UNITS:
            raise ConfigError(f'{key}: cannot read size {value!r}; write e.g. 4096 or "64MiB"')
        size = int(match.group(1)) * _UNITS[unit]
    else:
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if size < 0:
        raise ConfigError(f"{key}: size must not be negative, got {value!r}")
    return size


def _build(cls: type, table: dict[str, Any], prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if dotted in RENAMED_KEYS:
            new = RENAMED_KEYS[dotted]
            log.warning("config key %r was renamed to %r; please update the file", dotted, new)
            key = new.rsplit(".", 1)[-1]
            dotted = new
        if dotted in REMOVED_KEYS:
            log.warning("config key %r is no longer read (%s); please remove it", dotted, REMOVED_KEYS[dotted])
            continue
        if key not in fields:
            hint = difflib.get_close_matches(key, fields, n=1)
            did_you_mean = f"; did you mean {prefix + hint[0]!r}?" if hint else ""
            raise ConfigError(
                f"unknown config key {dotted!r}{did_you_mean} "
                f"(known in [{prefix.rstrip('.') or 'top level'}]: {', '.join(sorted(fields))})"
            )
        kwargs[key] = _coerce(fields[key], value, dotted)
    return cls(**kwargs)


def _coerce(f: dataclasses.Field, value: Any, dotted: str) -> Any:
    if dotted in _SECTIONS:
        if not isinstance(value, dict):
            raise ConfigError(f"{dotted}: expected a table [{dotted}], got {value!r}")
        return _build(_SECTIONS[dotted], value, f"{dotted}.")
    if f.name in _SIZE_FIELDS:
        return parse_size(value, key=dotted)
    # Annotations are strings here (postponed evaluation): "str", "int", "float" or "bool".
    expected = {"str": str, "int": int, "float": (int, float), "bool": bool}[f.type]
    if f.type == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{dotted}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, expected):
        raise ConfigError(f"{dotted}: expected {f.type}, got {value!r}")
    return float(value) if f.type == "float" else value


_CPU_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_list(text: str, *, key: str = "server.cpus") -> frozenset[int]:
    """The CPUs of a list such as "0-7,16" (Linux's cpulist format, as taskset -c and
    systemd's CPUAffinity= write it); ValueError naming `key` for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        found = _CPU_RANGE.match(part.strip())
        if found is None:
            raise ValueError(f'{key}: {part.strip()!r} is not a CPU or a range of CPUs (e.g. "0-7,16")')
        first, last = int(found[1]), int(found[2] or found[1])
        if last < first:
            raise ValueError(f"{key}: the range {part.strip()!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def validate(config: DaemonConfig) -> DaemonConfig:
    """Checks values that parse but cannot work; returns the config unchanged."""
    if config.store.shard_bytes < 4096:
        raise ConfigError(f"store.shard_bytes must be at least 4096, got {config.store.shard_bytes}")
    if config.store.prefetch_depth < 0:
        raise ConfigError("store.prefetch_depth must be >= 0")
    if not 0 < config.store.nvme_floor_seconds <= 3600:
        raise ConfigError(
            f"store.nvme_floor_seconds must be above 0 and at most 3600 (how often committed versions are "
            f"recorded), got {config.store.nvme_floor_seconds}"
        )
    if config.store.nvme_spare_slots < 1:
        raise ConfigError("store.nvme_spare_slots must be at least 1 (a new version needs a free slot)")
    if config.store.io_threads < 1:
        raise ConfigError("store.io_threads must be at least 1")
    if config.store.io_read_threads < 1:
        raise ConfigError("store.io_read_threads must be at least 1")
    if config.store.optimizer_threads < 0:
        raise ConfigError(
            f"store.optimizer_threads must be at least 0 (0: one per CPU), got {config.store.optimizer_threads}"
        )
    if config.server.health_check_seconds <= 0:
        raise ConfigError(f"server.health_check_seconds must be above 0, got {config.server.health_check_seconds}")
    if config.server.local_group:
        try:
            grp.getgrnam(config.server.local_group)
        except KeyError:
            raise ConfigError(
                f"server.local_group: no group named {config.server.local_group!r} on this host (groupadd --system "
                f"{config.server.local_group}, and add the trainers' users to it)"
            ) from None
    if config.server.scheduling not in SCHEDULING:
        raise ConfigError(
            f"server.scheduling must be one of {', '.join(map(repr, SCHEDULING))}, got {config.server.scheduling!r}"
        )
    if config.server.cpus:
        try:
            parse_cpu_list(config.server.cpus)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if config.store.max_models < 1 or config.store.max_shards_per_model < 1:
        raise ConfigError("store.max_models and store.max_shards_per_model must be at least 1")
    if config.server.max_workers < 2:
        raise ConfigError("server.max_workers must be at least 2")
    if not 0 <= config.server.max_calls_per_client <= config.server.max_workers:
        raise ConfigError(
            f"server.max_calls_per_client must be in [0, server.max_workers] (0: half of them), got "
            f"{config.server.max_calls_per_client}"
        )
    server = config.server
    if min(server.max_data_connections, server.max_data_connections_per_client, server.data_workers) < 1:
        raise ConfigError(
            "server.max_data_connections, server.max_data_connections_per_client and server.data_workers must "
            "each be at least 1"
        )
    if not (server.data_idle_seconds > 0 and server.data_stall_seconds > 0):
        raise ConfigError("server.data_idle_seconds and server.data_stall_seconds must be above 0")
    if not 0 <= config.server.max_waiting_pulls < config.server.max_workers:
        raise ConfigError(
            f"server.max_waiting_pulls must be in [0, server.max_workers) (0: half of them), got "
            f"{config.server.max_waiting_pulls}: waiting pulls must leave threads for everything else"
        )
    if server.max_waiting_pulls_per_client < 0:
        raise ConfigError(
            f"server.max_waiting_pulls_per_client must be at least 0 (0: half of max_waiting_pulls), got "
            f"{server.max_waiting_pulls_per_client}"
        )
    _check_addresses(config)
    if config.server.max_message_bytes < 64 << 10:
        raise ConfigError("server.max_message_bytes must be at least 64KiB")
    tls = config.tls
    if bool(tls.cert_file) != bool(tls.key_file):
        raise ConfigError("tls.cert_file and tls.key_file go together: set both (TLS) or neither (plaintext)")
    if tls.client_ca_file and not tls.cert_file:
        raise ConfigError("tls.client_ca_file (mutual TLS) needs tls.cert_file and tls.key_file too")
    for key in ("cert_file", "key_file", "client_ca_file"):
        path = getattr(tls, key)
        if path and not Path(path).is_file():
            raise ConfigError(f"tls.{key}: {path} is not a readable file")
    if config.auth.require_token not in ("admin", "all"):
        raise ConfigError(f'auth.require_token must be "admin" or "all", got {config.auth.require_token!r}')
    if config.auth.token_file and not Path(config.auth.token_file).is_file():
        raise ConfigError(f"auth.token_file: {config.auth.token_file} is not a readable file")
    exposed = exposed_in_plaintext(config)
    if exposed and not config.server.insecure:
        token = " and its auth token" if config.auth.token_file else ""
        raise ConfigError(
            f"{exposed} is not a loopback address and [tls] is not set, so its traffic{token} would travel in "
            "clear: set tls.cert_file and tls.key_file, or start with --insecure (server.insecure = true) on a "
            "network you trust"
        )
    if logging.getLevelName(config.log.level.upper()) == f"Level {config.log.level.upper()}":
        raise ConfigError(f"log.level: unknown level {config.log.level!r}")
    if config.log.format not in ("text", "json"):
        raise ConfigError(f'log.format must be "text" or "json", got {config.log.format!r}')
    return config


def _check_addresses(config: DaemonConfig) -> None:
    """Every address is host:port with a port in 0-65535 (0: a free one), and the fixed ports
    of one host differ: a bad one must fail here, naming its key, not in the socket layer."""
    server = config.server
    addresses = {"server.listen": _port_of("server.listen", server.listen, "")}
    if server.data_listen not in ("auto", "off"):
        addresses["server.data_listen"] = _port_of("server.data_listen", server.data_listen, ' "auto", "off" or')
    if config.metrics.listen:
        addresses["metrics.listen"] = _port_of("metrics.listen", config.metrics.listen, " empty (off) or")
    if server.health_listen:
        addresses["server.health_listen"] = _port_of("server.health_listen", server.health_listen, " empty (off) or")
    seen: dict[int, str] = {}
    for key, port in addresses.items():
        if port and port in seen:
            raise ConfigError(f"{seen[port]} and {key} both ask for port {port}: give each its own (or 0)")
        seen[port] = key


def _port_of(key: str, address: str, other_forms: str) -> int:
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):(\d{1,5})", address)
    if match is None:
        raise ConfigError(f"{key} must be{other_forms} host:port (e.g. 127.0.0.1:50051, [::1]:50051), got {address!r}")
    port = int(match.group(2))
    if port > 65535:
        raise ConfigError(f"{key}: port {port} is out of range (0-65535; 0 picks a free one), in {address!r}")
    return port


def exposed_in_plaintext(config: DaemonConfig) -> str:
    """Which of the daemon's data-carrying addresses ("server.listen ..." or "server.data_listen
    ...") is reachable beyond this host without TLS; "" when none is."""
    if config.tls.cert_file:
        return ""
    for key, address in (("server.listen", config.server.listen), ("server.data_listen", config.server.data_listen)):
        if address in ("auto", "off"):
            continue
        if not _is_loopback(address.rpartition(":")[0]):
            return f"{key} {address}"
    return ""


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost, or "" (every interface)


def load_config(path: str | Path | None, **overrides: Any) -> DaemonConfig:
    """Reads a TOML file (or defaults when `path` is None) and applies overrides given as
    dotted keys with underscores for dots, e.g. ``server__listen="127.0.0.1:0"``."""
    table: dict[str, Any] = {}
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text: {exc}") from exc
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, key = dotted.split("__", 1)
        table.setdefault(section, {})[key] = value
    return validate(_build(DaemonConfig, table, ""))
