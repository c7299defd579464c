"""`ps-admin`: an operator's read-only view of running ps-daemons, over the Admin service.

    ps-admin shards [--model NAME] [--daemon ADDR ...] [--json]
    ps-admin shard ID [--model NAME] [--daemon ADDR] [--json]
    ps-admin stats [--daemon ADDR ...] [--json]

Each response becomes a plain dict (`shard_to_dict`, `stats_to_dict`); `--json` prints those
as they are and the tables only format them, so the two views cannot disagree. A failed RPC
becomes one line on stderr and exit code 1; usage errors exit 2 (typer).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Annotated, Any, Optional, TypeVar

import grpc
import typer
from rich.console import Console
from rich.table import Table

from ps_proto import ps_pb2, ps_pb2_grpc

DEFAULT_DAEMON = "127.0.0.1:50051"
PARAMS_WIDTH = 40  # the params column shows "first +N more" past this many characters
T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect running ps-daemons.")

_DAEMON_HELP = f"host:port of a daemon. Default: $PS_DAEMON or {DEFAULT_DAEMON}."
DaemonsOpt = Annotated[Optional[list[str]], typer.Option(envvar="PS_DAEMON", help=_DAEMON_HELP + " Repeatable.")]
DaemonOpt = Annotated[Optional[str], typer.Option(envvar="PS_DAEMON", help=_DAEMON_HELP)]
ModelOpt = Annotated[Optional[str], typer.Option(help="Model name (default: every model / the only one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON to stdout instead of a table.")]
TimeoutOpt = Annotated[float, typer.Option(min=0.1, help="Deadline of each RPC, in seconds.")]


class AdminError(Exception):
    """A failure worth one line on stderr (without the "ps-admin: " prefix)."""


# -- responses to plain dicts ------------------------------------------------------------


def _finite(x: float) -> float | None:
    # Strict JSON has no NaN/Infinity; null keeps the output parseable (nan_count says why).
    return x if math.isfinite(x) else None


def shard_to_dict(info: ps_pb2.ShardInfo, daemon: str, *, values: bool = False) -> dict[str, Any]:
    """One shard's metadata; `values` adds GetShard's value statistics."""
    d: dict[str, Any] = {
        "daemon": daemon,
        "model": info.model,
        "shard_id": info.shard_id,
        "params": list(info.params),
        "offset": info.offset,
        "numel": info.numel,
        "bytes": info.bytes,
        "tier": info.tier,
        "version": info.version,
        "initialized": info.initialized,
    }
    if values:
        d.update(norm=_finite(info.norm), min=_finite(info.min), max=_finite(info.max), nan_count=info.nan_count)
    return d


def stats_to_dict(stats: ps_pb2.StatsResponse, daemon: str) -> dict[str, Any]:
    """Every field of StatsResponse, read from the descriptor so a field added to ps.proto
    shows up here without a change."""
    return {"daemon": daemon, **{f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}}


# -- formatting --------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    """1536 -> "1.5 KiB"; binary units, as shard sizes are set in them."""
    size, units = float(n), ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    i = 0
    while size >= 1024 and i < len(units) - 1:
        size, i = size / 1024, i + 1
    return f"{n} B" if i == 0 else f"{size:.1f} {units[i]}"


def short_params(names: list[str]) -> str:
    joined = ", ".join(names)
    if len(joined) <= PARAMS_WIDTH or len(names) == 1:
        return joined
    return f"{names[0]} +{len(names) - 1} more"


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if "bytes" in key.split("_"):
        return human_bytes(value)
    if key.endswith("_seconds"):
        return f"{value:.3f} s"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "\n".join(value)
    return str(value)


def _console() -> Console:
    # Piped output (grep, less) would otherwise be cut to 80 columns and tables would fold
    # names mid-word; tables only take the width they need, so a wide limit costs nothing.
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=400)
    return console


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, allow_nan=False))


# -- RPCs --------------------------------------------------------------------------------


def _rpc(daemon: str, what: str, call: Callable[[ps_pb2_grpc.AdminStub], T]) -> T:
    """Runs `call` on a fresh channel to `daemon`; turns gRPC errors into AdminError."""
    # No receive limit: a daemon with many shards answers ListShards with one big message.
    options = [("grpc.max_receive_message_length", -1)]
    try:
        with grpc.insecure_channel(daemon, options=options) as channel:
            return call(ps_pb2_grpc.AdminStub(channel))
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()  # type: ignore[attr-defined]  # a grpc.Call too
        if code == grpc.StatusCode.UNAVAILABLE:
            raise AdminError(f"daemon {daemon} is unreachable ({code.name}: {details})") from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # a busy daemon and a blackholed address look alike
            raise AdminError(f"daemon {daemon} did not answer in time, {what} ({code.name}: {details})") from None
        raise AdminError(f"{what} on daemon {daemon}: {code.name}: {details}") from None


def _list_shards(daemon: str, model: str, timeout: float) -> list[ps_pb2.ShardInfo]:
    what = f"listing shards of model {model!r}" if model else "listing shards"
    request = ps_pb2.ListShardsRequest(model=model)
    return list(_rpc(daemon, what, lambda stub: stub.ListShards(request, timeout=timeout)).shards)


def _fail(message: str) -> None:
    typer.echo(f"ps-admin: {message}", err=True)


def _each_daemon(daemons: list[str], fetch: Callable[[str], T]) -> tuple[list[tuple[str, T]], bool]:
    """Asks every daemon; one that fails is reported and skipped, so one dead daemon does
    not hide the others. Returns the answers and whether any failed."""
    answers, failed = [], False
    for daemon in daemons:
        try:
            answers.append((daemon, fetch(daemon)))
        except AdminError as exc:
            _fail(str(exc))
            failed = True
    return answers, failed


def _resolve_model(address: str, model: str | None, timeout: float) -> str:
    """The model named, or the only one the daemon holds shards of (the Admin API has no
    ListModels; the shards will do)."""
    if model:
        return model
    names = sorted({info.model for info in _list_shards(address, "", timeout)})
    if len(names) != 1:
        held = f"several models ({', '.join(names)})" if names else "no shards of any model"
        raise AdminError(f"daemon {address} holds {held}; name one with --model")
    return names[0]


def _move(verb: str, shard_ids: list[int], model: str | None, daemon: str | None, timeout: float) -> None:
    """evict / prefetch: one RPC per shard, one line per shard, exit 1 if any failed."""
    address = daemon or DEFAULT_DAEMON
    failed = False
    try:
        model = _resolve_model(address, model, timeout)
    except AdminError as exc:
        _fail(str(exc))
        raise typer.Exit(1) from None
    method = "Evict" if verb == "evict" else "Load"
    for shard_id in shard_ids:
        request = ps_pb2.GetShardRequest(model=model, shard_id=shard_id)
        what = f"{verb} of shard {shard_id} of model {model!r}"
        try:
            answer = _rpc(address, what, lambda stub, r=request: getattr(stub, method)(r, timeout=timeout))
        except AdminError as exc:
            _fail(str(exc))
            failed = True
            continue
        typer.echo(f"shard {shard_id}: {answer.tier}")
    if failed:
        raise typer.Exit(1)


# -- commands ----------------------------------------------------------------------------


@app.callback()
def main() -> None:
    """Inspect running ps-daemons; move shards between their tiers."""


@app.command()
def shards(
    model: ModelOpt = None, daemon: DaemonsOpt = None, as_json: JsonOpt = False, timeout: TimeoutOpt = 10.0
) -> None:
    """List the shards each daemon holds."""
    daemons = daemon or [DEFAULT_DAEMON]
    answers, failed = _each_daemon(daemons, lambda d: _list_shards(d, model or "", timeout))
    if not answers:  # nothing to show; the errors are on stderr
        raise typer.Exit(1)
    rows = [shard_to_dict(info, d) for d, infos in answers for info in infos]
    if as_json:
        _print_json(rows)
    else:
        multi = len(daemons) > 1  # a daemon column only where there is a choice of daemon
        table = Table(title=None if multi else f"shards on {daemons[0]}")
        for name in ["daemon"] * multi + ["shard", "model", "parameters", "numel", "bytes", "tier", "version"]:
            table.add_column(name, justify="right" if name in ("shard", "numel", "bytes", "version") else "left")
        table.add_column("initialized")
        for r in rows:
            cells = [str(r["shard_id"]), r["model"], short_params(r["params"]), str(r["numel"])]
            cells += [human_bytes(r["bytes"]), r["tier"], str(r["version"]), "yes" if r["initialized"] else "no"]
            table.add_row(*[r["daemon"]] * multi, *cells)
        _console().print(table)
    if failed:
        raise typer.Exit(1)


@app.command()
def shard(
    shard_id: Annotated[int, typer.Argument(min=0, max=2**32 - 1, help="Shard id.")],
    model: ModelOpt = None,
    daemon: DaemonOpt = None,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Show one shard: metadata and value statistics of its master copy."""
    address = daemon or DEFAULT_DAEMON
    try:
        model = _resolve_model(address, model, timeout)
        request = ps_pb2.GetShardRequest(model=model, shard_id=shard_id)
        what = f"shard {shard_id} of model {model!r}"
        info = _rpc(address, what, lambda stub: stub.GetShard(request, timeout=timeout))
    except AdminError as exc:
        _fail(str(exc))
        raise typer.Exit(1) from None
    row = shard_to_dict(info, address, values=True)
    if as_json:
        _print_json(row)
        return
    table = Table("field", "value")
    for key, value in row.items():
        table.add_row(key, _cell(key, value))
    _console().print(table)


@app.command()
def stats(daemon: DaemonsOpt = None, as_json: JsonOpt = False, timeout: TimeoutOpt = 10.0) -> None:
    """Counters of each daemon. --json: one object for one daemon, a list for several."""
    daemons = daemon or [DEFAULT_DAEMON]
    request = ps_pb2.StatsRequest()
    answers, failed = _each_daemon(
        daemons, lambda d: _rpc(d, "stats", lambda stub: stub.Stats(request, timeout=timeout))
    )
    if not answers:
        raise typer.Exit(1)
    rows = [stats_to_dict(response, d) for d, response in answers]
    if as_json:
        _print_json(rows[0] if len(daemons) == 1 else rows)
    else:
        table = Table("field", *(r["daemon"] for r in rows))
        for key in [k for k in rows[0] if k != "daemon"]:
            table.add_row(key, *(_cell(key, r[key]) for r in rows))
        _console().print(table)
    if failed:
        raise typer.Exit(1)


ShardIds = Annotated[list[int], typer.Argument(min=0, max=2**32 - 1, help="Shard ids.")]


@app.command()
def evict(shard_ids: ShardIds, model: ModelOpt = None, daemon: DaemonOpt = None, timeout: TimeoutOpt = 10.0) -> None:
    """Drop shards from the RAM tier; they stay committed on NVMe."""
    _move("evict", shard_ids, model, daemon, timeout)


@app.command()
def prefetch(shard_ids: ShardIds, model: ModelOpt = None, daemon: DaemonOpt = None, timeout: TimeoutOpt = 60.0) -> None:
    """Read shards into the RAM tier now."""
    _move("prefetch", shard_ids, model, daemon, timeout)


if __name__ == "__main__":
    app()
