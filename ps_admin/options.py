"""What every ps-admin command shares: the default daemon, the option types, and how a
failure is said."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from ps_offload.proto.cluster import ENV_CLUSTER_FILE, ENV_DAEMONS, daemon_addresses

DEFAULT_DAEMON = "127.0.0.1:50051"

_DAEMON_HELP = (
    f"host:port of a daemon. Default: $PS_DAEMON, else the trainers' $PS_DAEMONS or $PS_CLUSTER_FILE, else "
    f"{DEFAULT_DAEMON}."
)
DaemonsOpt = Annotated[Optional[list[str]], typer.Option(envvar="PS_DAEMON", help=_DAEMON_HELP + " Repeatable.")]
DaemonOpt = Annotated[Optional[str], typer.Option(envvar="PS_DAEMON", help=_DAEMON_HELP)]
ModelOpt = Annotated[Optional[str], typer.Option(help="Model name (default: every model / the only one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON to stdout instead of a table.")]
TimeoutOpt = Annotated[float, typer.Option(min=0.1, help="Deadline of each RPC, in seconds.")]
ShardIds = Annotated[list[int], typer.Argument(min=0, max=2**32 - 1, help="Shard ids.")]


def fail(message: str) -> None:
    typer.echo(f"ps-admin: {message}", err=True)


def unique_daemons(daemons: list[str] | None) -> list[str]:
    """The daemons named (--daemon, $PS_DAEMON); else the job's list as its trainers read it
    ($PS_DAEMONS, comma-separated, or the cluster file $PS_CLUSTER_FILE: ps_proto/cluster.py),
    so one setting serves both; else the default daemon."""
    if daemons:
        return list(dict.fromkeys(daemons))
    if os.environ.get(ENV_DAEMONS) or os.environ.get(ENV_CLUSTER_FILE):
        try:
            return daemon_addresses()
        except ValueError as exc:
            fail(str(exc))
            raise typer.Exit(2) from None
    return [DEFAULT_DAEMON]
