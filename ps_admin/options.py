"""What every ps-admin command shares: the default daemon, the option types, and how a
failure is said."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

DEFAULT_DAEMON = "127.0.0.1:50051"

_DAEMON_HELP = f"host:port of a daemon. Default: $PS_DAEMON or {DEFAULT_DAEMON}."
DaemonsOpt = Annotated[Optional[list[str]], typer.Option(envvar="PS_DAEMON", help=_DAEMON_HELP + " Repeatable.")]
DaemonOpt = Annotated[Optional[str], typer.Option(envvar="PS_DAEMON", help=_DAEMON_HELP)]
ModelOpt = Annotated[Optional[str], typer.Option(help="Model name (default: every model / the only one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON to stdout instead of a table.")]
TimeoutOpt = Annotated[float, typer.Option(min=0.1, help="Deadline of each RPC, in seconds.")]
ShardIds = Annotated[list[int], typer.Argument(min=0, max=2**32 - 1, help="Shard ids.")]


def fail(message: str) -> None:
    typer.echo(f"ps-admin: {message}", err=True)


def unique_daemons(daemons: list[str] | None) -> list[str]:
    return list(dict.fromkeys(daemons or [DEFAULT_DAEMON]))
