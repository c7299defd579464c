"""Where the daemons are: one ordered list of addresses, the same in every trainer process.

The order is part of the shard plan (shard i of a model lives on daemon i mod n, in this
order), so every process of a job must read the same list. It comes from the first of:

1. an explicit list (a script's `--daemons a:p,b:p` flag), or an explicit cluster file;
2. the environment variable PS_DAEMONS (comma-separated);
3. the cluster file named by PS_CLUSTER_FILE: a small TOML file, the same on every node,

       # one ps-daemon per node, in plan order
       daemons = ["node0:50051", "node1:50051"]

Nothing found is an error that names all three, never a silent default: a trainer that
guessed "localhost" on a multi-node job would train against a daemon of its own.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV_DAEMONS = "PS_DAEMONS"
ENV_CLUSTER_FILE = "PS_CLUSTER_FILE"
CLUSTER_FILE_KEYS = frozenset({"daemons"})


def daemon_addresses(
    daemons: str | Sequence[str] | None = None,
    *,
    cluster_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The daemon list, from the arguments or else the environment (see the module doc)."""
    environ = os.environ if environ is None else environ
    if daemons and cluster_file:
        raise ValueError("give the daemons either as a list or as a cluster file, not both")
    if daemons:
        return _checked(_split(daemons), "the daemon list")
    if cluster_file:
        return read_cluster_file(cluster_file)
    if environ.get(ENV_DAEMONS):
        return _checked(_split(environ[ENV_DAEMONS]), f"${ENV_DAEMONS}")
    if environ.get(ENV_CLUSTER_FILE):
        return read_cluster_file(environ[ENV_CLUSTER_FILE])
    raise ValueError(
        f"no daemons given: pass --daemons HOST:PORT[,HOST:PORT...], or set ${ENV_DAEMONS}, or point "
        f'${ENV_CLUSTER_FILE} at a TOML file with daemons = ["HOST:PORT", ...]'
    )


def read_cluster_file(path: str | Path) -> list[str]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read cluster file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"cluster file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - CLUSTER_FILE_KEYS)
    if unknown:
        raise ValueError(f"cluster file {path}: unknown keys {unknown}; it takes only {sorted(CLUSTER_FILE_KEYS)}")
    daemons = data.get("daemons")
    if not isinstance(daemons, list) or not daemons or not all(isinstance(d, str) for d in daemons):
        raise ValueError(f'cluster file {path}: daemons must be a non-empty list of "HOST:PORT" strings')
    return _checked(daemons, f"cluster file {path}")


def _split(daemons: str | Sequence[str]) -> list[str]:
    items = daemons.split(",") if isinstance(daemons, str) else list(daemons)
    return [item.strip() for item in items if item.strip()]


def _bad_address(address: object) -> bool:
    """Not "HOST:PORT" with a port in 1-65535 (gRPC would take a missing port as 443)."""
    host, sep, port = str(address).rpartition(":")
    return not isinstance(address, str) or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536


def _repeated(addresses: Sequence[str]) -> list[str]:
    return sorted({a for a in addresses if list(addresses).count(a) > 1})


def _checked(addresses: list[str], where: str) -> list[str]:
    for address in addresses:
        if _bad_address(address):
            raise ValueError(f'{where}: {address!r} is not "HOST:PORT"')
    repeated = _repeated(addresses)
    if repeated:
        raise ValueError(f"{where} names {repeated} more than once; each daemon takes one place in the plan")
    return addresses


def check_daemon_list(daemons: object) -> None:
    """Raises ValueError at once, saying what to write, unless `daemons` is a non-empty list of
    distinct host:port addresses (a port gRPC would otherwise take as 443, and time out)."""
    if isinstance(daemons, str):
        listed = [d.strip() for d in daemons.split(",")]
        raise ValueError(f"daemons must be a list of host:port addresses, not the string {daemons!r}: write {listed!r}")
    if not isinstance(daemons, (list, tuple)) or not daemons:
        raise ValueError(f"daemons must be a non-empty list of host:port addresses, got {daemons!r}")
    for address in daemons:
        if _bad_address(address):
            raise ValueError(
                f"daemon address {address!r} is not host:port with a port in 1-65535 (e.g. '10.0.0.5:50051'; "
                "a daemon's port is its server.listen)"
            )
    repeated = _repeated(daemons)
    if repeated:
        raise ValueError(f"daemon addresses repeat: {repeated} in {list(daemons)}; each daemon once, in plan order")
