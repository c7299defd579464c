"""`ps-admin`: an operator's view of running ps-daemons, over the Admin service.

    ps-admin models   [--daemon ADDR ...] [--json]
    ps-admin shards   [--model NAME] [--daemon ADDR ...] [--tier T] [--param TEXT] [--sort KEY] [--json]
    ps-admin shard ID [--model NAME] [--daemon ADDR] [--bins N] [--json]
    ps-admin stats    [--daemon ADDR ...] [--interval SECONDS] [--json]
    ps-admin verify   [--model NAME] [--daemon ADDR ...] [--json]
    ps-admin export   --out FILE [--model NAME] [--format safetensors] [--daemon ADDR ...] [--json]
    ps-admin health   [--daemon ADDR ...] [--json]
    ps-admin evict ID... / prefetch ID... [--model NAME] [--daemon ADDR]

Each response becomes a plain dict (`shard_to_dict`, `stats_to_dict`, ...); `--json` prints
those as they are and the tables only format them, so the two views cannot disagree. A failed
RPC becomes one line on stderr and exit code 1; usage errors exit 2. Progress bars of the long
commands (verify, export) go to stderr, and only when it is a terminal.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import grpc
import torch
import typer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ps_offload.proto import codec, ps_pb2, ps_pb2_grpc
from ps_offload.proto.plan import ParamLayout, ShardSlice, segments_of
from ps_offload.proto.security import ClientSecurity

DEFAULT_DAEMON = "127.0.0.1:50051"
PARAMS_WIDTH = 40  # the params column shows "first +N more" past this many characters
BAR_WIDTH = 40  # characters of the longest histogram bar
EXPORT_FORMATS = ("safetensors",)
T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect running ps-daemons.")

_DAEMON_HELP = f"host:port of a daemon. Default: $PS_DAEMON or {DEFAULT_DAEMON}."
DaemonsOpt = Annotated[Optional[list[str]], typer.Option(envvar="PS_DAEMON", help=_DAEMON_HELP + " Repeatable.")]
DaemonOpt = Annotated[Optional[str], typer.Option(envvar="PS_DAEMON", help=_DAEMON_HELP)]
ModelOpt = Annotated[Optional[str], typer.Option(help="Model name (default: every model / the only one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON to stdout instead of a table.")]
TimeoutOpt = Annotated[float, typer.Option(min=0.1, help="Deadline of each RPC, in seconds.")]


class Tier(StrEnum):
    ram = "ram"
    nvme = "nvme"
    corrupt = "corrupt"


class SortKey(StrEnum):
    id = "id"
    version = "version"
    bytes = "bytes"
    tier = "tier"


class AdminError(Exception):
    """A failure worth one line on stderr (without the "ps-admin: " prefix)."""


# -- responses to plain dicts ------------------------------------------------------------


def _finite(x: float) -> float | None:
    # Strict JSON has no NaN/Infinity; null keeps the output parseable (nan_count says why).
    return x if math.isfinite(x) else None


def shard_to_dict(info: ps_pb2.ShardInfo, daemon: str, *, values: bool = False) -> dict[str, Any]:
    """One shard's metadata; `values` adds GetShard's value statistics and histogram."""
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
        d["histogram"] = histogram_to_dict(list(info.histogram), info.histogram_low, info.histogram_high)
    return d


def histogram_to_dict(counts: list[int], low: float, high: float) -> dict[str, list]:
    """Bin edges (one more than counts) and counts; equal bins from low to high."""
    n = len(counts)
    edges = [low + (high - low) * i / n for i in range(n)] + [high] if n else []
    return {"edges": edges, "counts": counts}


def stats_to_dict(stats: ps_pb2.StatsResponse, daemon: str) -> dict[str, Any]:
    """Every field of StatsResponse, read from the descriptor so a field added to ps.proto
    shows up here without a change."""
    return {"daemon": daemon, **{f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}}


def rates(last: dict[str, Any], first: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rates from stats_to_dict samples: between two (`first`, then `last`), or since the
    daemon started (`first` None), timed by the daemon's own uptime_seconds.

    prefetch_hit_rate: of the shards read from NVMe, the share read ahead of use (prefetched)
    rather than when a pull or push asked for it (a miss). A prefetched shard evicted before
    its use still counts as read ahead. ram_hit_rate: of all uses, the share that found the
    shard resident (a pull right after its push always does). None without NVMe reads."""

    def delta(key: str) -> float:
        return last[key] - (first[key] if first else 0)

    seconds = delta("uptime_seconds")
    per_second = (lambda key: delta(key) / seconds) if seconds > 0 else (lambda key: None)
    prefetched, misses, hits = delta("prefetched"), delta("tier_misses"), delta("tier_hits")
    return {
        "rates_since": "interval" if first else "start",
        "rates_seconds": seconds,
        "pushes_per_second": per_second("pushes_applied"),
        "pulls_per_second": per_second("pulls"),
        "bytes_in_per_second": per_second("bytes_pushed"),
        "bytes_out_per_second": per_second("bytes_pulled"),
        "prefetch_hit_rate": prefetched / (prefetched + misses) if prefetched + misses else None,
        "ram_hit_rate": hits / (hits + misses) if hits + misses else None,
    }


def model_to_dict(info: ps_pb2.ModelInfo, daemon: str) -> dict[str, Any]:
    spec = info.spec
    optimizer = spec.optimizer.WhichOneof("kind")
    fields = getattr(spec.optimizer, optimizer) if optimizer else None
    return {
        "daemon": daemon,
        "model": spec.model,
        "daemon_index": info.daemon_index,
        "daemons": list(spec.daemons),
        "shard_bytes": spec.shard_bytes,
        "numel": info.total_numel,
        "shards": len(info.shards),
        "shards_here": sum(s.daemon_index == info.daemon_index for s in info.shards),
        "optimizer": {"type": optimizer, **{f.name: getattr(fields, f.name) for f in fields.DESCRIPTOR.fields}}
        if fields is not None
        else None,
        "params": [{"name": p.name, "shape": list(p.shape), "offset": p.offset, "numel": p.numel} for p in info.params],
    }


def verdict_to_dict(v: ps_pb2.ShardVerdict, daemon: str) -> dict[str, Any]:
    status = ps_pb2.VerifyStatus.Name(v.status).removeprefix("VERIFY_").lower()
    return {
        "daemon": daemon,
        "model": v.model,
        "shard_id": v.shard_id,
        "status": status,
        "detail": v.detail,
        "version": v.version,
        "tier": v.tier,
        "bytes_read": v.bytes_read,
        "nonfinite": v.nonfinite,
    }


# -- formatting --------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; binary units, as shard sizes are set in them."""
    size, units = float(n), ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    i = 0
    while size >= 1024 and i < len(units) - 1:
        size, i = size / 1024, i + 1
    return f"{round(n)} B" if i == 0 else f"{size:.1f} {units[i]}"


def short_params(names: list[str]) -> str:
    joined = ", ".join(names)
    if len(joined) <= PARAMS_WIDTH or len(names) == 1:
        return joined
    return f"{names[0]} +{len(names) - 1} more"


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    words = key.split("_")
    if key.endswith("_per_second"):
        return f"{human_bytes(value)}/s" if "bytes" in words else f"{value:.2f}/s"
    if key.endswith("_rate"):
        return f"{100 * value:.1f}%"
    if "bytes" in words:
        return human_bytes(value)
    if key.endswith("_seconds"):
        return f"{value:.3f} s"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "\n".join(value)
    return str(value)


def bar(count: int, largest: int) -> str:
    """A text bar `count / largest` of BAR_WIDTH characters; a sliver for any count > 0."""
    if not count:
        return ""
    return "█" * max(1, round(BAR_WIDTH * count / largest)) if largest else ""


def _console() -> Console:
    # Piped output (grep, less) would otherwise be cut to 80 columns and tables would fold
    # names mid-word; tables only take the width they need, so a wide limit costs nothing.
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=400)
    return console


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, allow_nan=False))


@contextlib.contextmanager
def _progress(*, total_bytes: bool = False) -> Iterator[Progress]:
    """A progress bar on stderr, shown only when stderr is a terminal (so --json and piped
    output stay clean)."""
    console = Console(stderr=True)
    count = DownloadColumn(binary_units=True) if total_bytes else MofNCompleteColumn()
    columns = [TextColumn("{task.description}"), BarColumn(), count, TimeRemainingColumn()]
    with Progress(*columns, console=console, disable=not console.is_terminal, transient=True) as progress:
        yield progress


# -- RPCs --------------------------------------------------------------------------------


def _admin_error(daemon: str, what: str, exc: grpc.RpcError) -> AdminError:
    code, details = exc.code(), exc.details()  # type: ignore[attr-defined]  # a grpc.Call too
    if code == grpc.StatusCode.UNAVAILABLE:
        return AdminError(f"daemon {daemon} is unreachable ({code.name}: {details})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # a busy daemon and a blackholed address look alike
        return AdminError(f"daemon {daemon} did not answer in time, {what} ({code.name}: {details})")
    return AdminError(f"{what} on daemon {daemon}: {code.name}: {details}")


# How ps-admin connects (TLS, client certificate, token); set once by the main callback.
_security = ClientSecurity()


@contextlib.contextmanager
def _channel(daemon: str) -> Iterator[grpc.Channel]:
    """A channel to `daemon`: every call of ps-admin goes through here."""
    # No receive limit: a daemon with many shards answers ListShards with one big message.
    options = [("grpc.max_receive_message_length", -1)]
    with _security.channel(daemon, options) as channel:
        yield channel


def _rpc(daemon: str, what: str, call: Callable[[ps_pb2_grpc.AdminStub], T]) -> T:
    """Runs `call` on a fresh channel to `daemon`; turns gRPC errors into AdminError. A
    streaming call must be consumed inside `call`."""
    try:
        with _channel(daemon) as channel:
            return call(ps_pb2_grpc.AdminStub(channel))
    except grpc.RpcError as exc:
        raise _admin_error(daemon, what, exc) from None


def _list_shards(daemon: str, model: str, timeout: float) -> list[ps_pb2.ShardInfo]:
    what = f"listing shards of model {model!r}" if model else "listing shards"
    request = ps_pb2.ListShardsRequest(model=model)
    return list(_rpc(daemon, what, lambda stub: stub.ListShards(request, timeout=timeout)).shards)


def _list_models(daemon: str, timeout: float) -> list[ps_pb2.ModelInfo]:
    request = ps_pb2.ListModelsRequest()
    return list(_rpc(daemon, "listing models", lambda stub: stub.ListModels(request, timeout=timeout)).models)


def _get_model(daemon: str, model: str, timeout: float) -> ps_pb2.ModelInfo:
    request = ps_pb2.GetModelRequest(model=model)
    return _rpc(daemon, f"model {model!r}", lambda stub: stub.GetModel(request, timeout=timeout))


def _stats(daemon: str, timeout: float) -> dict[str, Any]:
    response = _rpc(daemon, "stats", lambda stub: stub.Stats(ps_pb2.StatsRequest(), timeout=timeout))
    return stats_to_dict(response, daemon)


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
    """The model named, or the only one the daemon holds."""
    if model:
        return model
    names = [info.spec.model for info in _list_models(address, timeout)]
    if len(names) != 1:
        held = f"several models ({', '.join(names)})" if names else "no model"
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


def _unique(daemons: list[str] | None) -> list[str]:
    return list(dict.fromkeys(daemons or [DEFAULT_DAEMON]))


# -- commands ----------------------------------------------------------------------------


@app.callback()
def main(
    ca_file: Annotated[
        Optional[str],
        typer.Option("--ca-file", envvar="PS_TLS_CA_FILE", help="CA that signed the daemons' certificates: use TLS."),
    ] = None,
    cert_file: Annotated[
        Optional[str],
        typer.Option("--cert-file", envvar="PS_TLS_CERT_FILE", help="Client certificate, for mutual TLS."),
    ] = None,
    key_file: Annotated[
        Optional[str], typer.Option("--key-file", envvar="PS_TLS_KEY_FILE", help="Key of --cert-file.")
    ] = None,
    token_file: Annotated[
        Optional[str],
        typer.Option(
            "--token-file", envvar="PS_TOKEN_FILE", help="File holding the daemons' bearer token (first line)."
        ),
    ] = None,
    server_name: Annotated[
        Optional[str],
        typer.Option("--server-name", envvar="PS_TLS_SERVER_NAME", help="Name to check the certificates against."),
    ] = None,
) -> None:
    """Inspect running ps-daemons; verify, export, move shards between their tiers."""
    global _security
    try:
        _security = ClientSecurity(
            ca_file=ca_file or "", cert_file=cert_file or "", key_file=key_file or "",
            token_file=token_file or "", server_name=server_name or "",
        )  # fmt: skip
        _security.token()  # a token file that cannot be read is one line now, not per call
    except ValueError as exc:
        _fail(str(exc).removeprefix("ClientSecurity: "))
        raise typer.Exit(1) from None


@app.command()
def models(daemon: DaemonsOpt = None, as_json: JsonOpt = False, timeout: TimeoutOpt = 10.0) -> None:
    """List the models each daemon holds: spec, plan, optimizer."""
    daemons = _unique(daemon)
    answers, failed = _each_daemon(daemons, lambda d: _list_models(d, timeout))
    if not answers:
        raise typer.Exit(1)
    rows = [model_to_dict(info, d) for d, infos in answers for info in infos]
    if as_json:
        _print_json(rows)
    else:
        table = Table("daemon", "model", "index", "params", "numel", "shards here", "shard bytes", "optimizer")
        for r in rows:
            o = r["optimizer"] or {}
            optimizer = f"{o.get('type')} lr={o.get('lr', 0):g}" if o else "-"
            table.add_row(
                r["daemon"], r["model"], f"{r['daemon_index']} of {len(r['daemons'])}", str(len(r["params"])),
                str(r["numel"]), f"{r['shards_here']} of {r['shards']}", human_bytes(r["shard_bytes"]), optimizer,
            )  # fmt: skip
        _console().print(table)
    if failed:
        raise typer.Exit(1)


_SORT_KEYS: dict[SortKey, Callable[[dict[str, Any]], tuple]] = {
    SortKey.id: lambda r: (r["model"], r["shard_id"], r["daemon"]),
    SortKey.version: lambda r: (r["version"], r["model"], r["shard_id"]),
    SortKey.bytes: lambda r: (r["bytes"], r["model"], r["shard_id"]),
    SortKey.tier: lambda r: (list(Tier).index(Tier(r["tier"])), r["model"], r["shard_id"]),
}


def select_shards(
    rows: list[dict[str, Any]], *, tier: Tier | None, param: str | None, sort: SortKey | None, reverse: bool
) -> list[dict[str, Any]]:
    """`shards`' filters (tier, a substring of a parameter name) and order (None: as the
    daemons listed them)."""
    rows = [r for r in rows if tier is None or r["tier"] == tier.value]
    rows = [r for r in rows if not param or any(param in name for name in r["params"])]
    if sort is not None:
        rows.sort(key=_SORT_KEYS[sort])
    return rows[::-1] if reverse else rows


@app.command()
def shards(
    model: ModelOpt = None,
    daemon: DaemonsOpt = None,
    tier: Annotated[Optional[Tier], typer.Option(help="Only shards in this tier.")] = None,
    param: Annotated[Optional[str], typer.Option(help="Only shards holding a parameter whose name has this.")] = None,
    sort: Annotated[Optional[SortKey], typer.Option(help="Order by this (default: as listed).")] = None,
    reverse: Annotated[bool, typer.Option("--reverse", help="Reverse the order.")] = False,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """List the shards each daemon holds."""
    daemons = _unique(daemon)
    answers, failed = _each_daemon(daemons, lambda d: _list_shards(d, model or "", timeout))
    if not answers:  # nothing to show; the errors are on stderr
        raise typer.Exit(1)
    rows = [shard_to_dict(info, d) for d, infos in answers for info in infos]
    rows = select_shards(rows, tier=tier, param=param, sort=sort, reverse=reverse)
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
    bins: Annotated[int, typer.Option(min=1, max=1000, help="Bins of the histogram of master values.")] = 20,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Show one shard: metadata, value statistics and a histogram of its master copy."""
    address = daemon or DEFAULT_DAEMON
    try:
        model = _resolve_model(address, model, timeout)
        request = ps_pb2.GetShardRequest(model=model, shard_id=shard_id, histogram_bins=bins)
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
        if key != "histogram":
            table.add_row(key, _cell(key, value))
    console = _console()
    console.print(table)
    edges, counts = row["histogram"]["edges"], row["histogram"]["counts"]
    histogram = Table("from", "to", "count", "", title="finite master values")
    for i, count in enumerate(counts):
        histogram.add_row(f"{edges[i]:.4g}", f"{edges[i + 1]:.4g}", str(count), bar(count, max(counts)))
    console.print(histogram)


@app.command()
def stats(
    daemon: DaemonsOpt = None,
    interval: Annotated[
        float, typer.Option(min=0, help="Rates over this many seconds between two samples (0: since the start).")
    ] = 0.0,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Counters, tier use and rates of each daemon (--json: an object, a list for several)."""
    daemons = _unique(daemon)
    answers, failed = _each_daemon(daemons, lambda d: _stats(d, timeout))
    if interval:
        time.sleep(interval)
        firsts = dict(answers)
        later, failed_later = _each_daemon(list(firsts), lambda d: _stats(d, timeout))
        answers, failed = [], failed or failed_later
        for d, last in later:
            if last["uptime_seconds"] < firsts[d]["uptime_seconds"]:
                _fail(f"daemon {d} restarted during the {interval:g} s interval")
                failed = True
            else:
                answers.append((d, {**last, **rates(last, firsts[d])}))
    else:
        answers = [(d, {**row, **rates(row)}) for d, row in answers]
    if not answers:
        raise typer.Exit(1)
    rows = [row for _, row in answers]
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


# -- verify ------------------------------------------------------------------------------


def _verify_daemon(address: str, model: str, timeout: float, progress: Progress) -> dict[str, Any]:
    """Streams one daemon's Verify; returns its summary with every verdict under "shards"."""
    what = f"verify of model {model!r}" if model else "verify"
    summary: dict[str, Any] = {"daemon": address}

    def call(stub: ps_pb2_grpc.AdminStub) -> None:
        task = None
        for answer in stub.Verify(ps_pb2.VerifyRequest(model=model), timeout=timeout):
            if answer.HasField("plan"):
                summary.update(at_rest=answer.plan.at_rest, planned_bytes=answer.plan.bytes, shards=[])
                task = progress.add_task(f"verify {address}", total=answer.plan.shards)
            else:
                summary["shards"].append(verdict_to_dict(answer.shard, address))
                progress.advance(task)

    _rpc(address, what, call)
    verdicts = summary["shards"]
    for status in ("ok", "bad", "not_at_rest"):
        summary[status] = sum(v["status"] == status for v in verdicts)
    summary["bytes_read"] = sum(v["bytes_read"] for v in verdicts)
    return summary


def _verify_line(s: dict[str, Any]) -> str:
    n = len(s["shards"])
    shards = f"{n} shard" + "s" * (n != 1)
    if not s["at_rest"]:
        nonfinite = sum(v["nonfinite"] > 0 for v in s["shards"])
        return (
            f"daemon {s['daemon']}: RAM only (no store.nvme_dir), nothing at rest to verify; {shards} checked "
            f"in memory, {nonfinite} with non-finite values"
        )
    line = f"daemon {s['daemon']}: {shards}, {s['ok']} ok, {s['bad']} bad ({human_bytes(s['bytes_read'])} read)"
    if s["not_at_rest"]:
        line += f", {s['not_at_rest']} never committed"
    return line


@app.command()
def verify(
    model: ModelOpt = None, daemon: DaemonsOpt = None, as_json: JsonOpt = False, timeout: TimeoutOpt = 3600.0
) -> None:
    """Read every committed shard back from NVMe and check its crc32c. Exit 1 if any is bad."""
    daemons = _unique(daemon)
    with _progress() as progress:
        answers, failed = _each_daemon(daemons, lambda d: _verify_daemon(d, model or "", timeout, progress))
    summaries = [s for _, s in answers]
    bad = [v for s in summaries for v in s["shards"] if v["status"] == "bad"]
    if as_json:
        _print_json({"bad": len(bad), "daemons": summaries})
    else:
        console = _console()
        for s in summaries:
            console.print(_verify_line(s), highlight=False)
        if bad:
            table = Table("daemon", "model", "shard", "version", "tier", "why", title="bad shards")
            for v in bad:
                table.add_row(v["daemon"], v["model"], str(v["shard_id"]), str(v["version"]), v["tier"], v["detail"])
            console.print(table)
    for v in bad:
        _fail(f"shard {v['shard_id']} of model {v['model']!r} on daemon {v['daemon']} is bad: {v['detail']}")
    if failed or bad:
        raise typer.Exit(1)


# -- export ------------------------------------------------------------------------------


def _owners(model: str, daemons: list[str], timeout: float) -> tuple[ps_pb2.ModelInfo, list[str]]:
    """The model's info and the address of every daemon of its plan: each daemon named
    answers which index it is; the others are taken from the spec's daemon list."""
    infos = [(d, _get_model(d, model, timeout)) for d in daemons]
    first_address, first = infos[0]
    addresses = list(first.spec.daemons)
    for address, info in infos:
        mine, theirs = _identity(first), _identity(info)
        if mine != theirs:
            raise AdminError(
                f"daemons {first_address} and {address} hold different models named {model!r}; "
                "name the daemons of one job with --daemon"
            )
        addresses[info.daemon_index] = address
    return first, addresses


def _identity(info: ps_pb2.ModelInfo) -> tuple:
    return (list(info.params), info.spec.shard_bytes, len(info.spec.daemons), list(info.shards))


def _pull_shard(
    channel: grpc.Channel, model: str, s: ShardSlice, version: int, timeout: float
) -> tuple[bytearray, int]:
    """A shard's master values (fp32 bytes) and the version read."""
    pull = channel.unary_stream(
        f"/{ps_pb2.DESCRIPTOR.services_by_name['ParameterServer'].full_name}/Pull",
        request_serializer=ps_pb2.PullRequest.SerializeToString,
        response_deserializer=codec.pull_chunks.decode,
    )
    request = ps_pb2.PullRequest(model=model, shard_id=s.shard_id, min_version=version, tensor=ps_pb2.MASTER)
    out, got, received = bytearray(s.numel * 4), -1, 0
    for chunk in pull(request, timeout=timeout):
        if chunk.header is not None:
            got = chunk.header.version
        n = len(chunk.data)
        if received + n > len(out):
            raise AdminError(f"shard {s.shard_id} came with more than its {s.numel} elements")
        out[received : received + n] = chunk.data
        received += n
    if received != len(out) or got < 0:
        raise AdminError(f"shard {s.shard_id} ended after {received} of {len(out)} bytes")
    return out, got


@contextlib.contextmanager
def _owner(address: str, named: list[str]) -> Iterator[None]:
    """Errors from a daemon the operator did not name (its address is the model spec's)
    say how to name it."""
    try:
        yield
    except AdminError as exc:
        if address in named:
            raise
        raise AdminError(f"{exc} (an address from the model's spec; name the daemon with --daemon)") from None


def _common_version(
    model: str, addresses: list[str], named: list[str], plan: list[ShardSlice], timeout: float
) -> tuple[int, int]:
    """The lowest and highest version among the model's shards; every shard must hold values."""
    versions = {}
    for index in sorted({s.daemon_index for s in plan}):
        with _owner(addresses[index], named):
            infos = _list_shards(addresses[index], model, timeout)
        for info in infos:
            if not info.initialized:
                raise AdminError(
                    f"shard {info.shard_id} of model {model!r} on daemon {addresses[index]} holds no values yet "
                    "(its trainer never pushed them); nothing to export"
                )
            versions[info.shard_id] = info.version
    return min(versions.values(), default=0), max(versions.values(), default=0)


def export_model(
    model: str, daemons: list[str], *, timeout: float, allow_mixed: bool, progress: Progress
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Pulls every shard of `model` from the daemons that own it and reassembles each
    parameter with its shape. Returns the tensors and safetensors metadata."""
    info, addresses = _owners(model, daemons, timeout)
    plan = [ShardSlice(s.shard_id, s.daemon_index, s.offset, s.numel) for s in info.shards]
    layouts = [ParamLayout(i, p.name, tuple(p.shape), p.offset, p.numel, None) for i, p in enumerate(info.params)]
    low, high = _common_version(model, addresses, daemons, plan, timeout)
    if low != high and not allow_mixed:
        raise AdminError(
            f"the shards of model {model!r} are at versions {low} to {high}: it is being trained. Export between "
            "steps, when it is idle, or pass --allow-mixed-versions"
        )
    flats = [torch.empty(p.numel, dtype=torch.float32) for p in layouts]
    task = progress.add_task(f"export {model}", total=info.total_numel * 4)

    def fetch(s: ShardSlice) -> int:
        address = addresses[s.daemon_index]
        with _owner(address, daemons):
            try:
                with _channel(address) as channel:
                    data, version = _pull_shard(channel, model, s, low, timeout)
            except grpc.RpcError as exc:
                raise _admin_error(address, f"pull of shard {s.shard_id} of model {model!r}", exc) from None
        values = torch.frombuffer(data, dtype=torch.float32)
        for seg in segments_of(s, layouts):  # disjoint pieces: shards may land in any order
            flats[seg.param_index][seg.param_start : seg.param_start + seg.numel] = values[
                seg.shard_start : seg.shard_start + seg.numel
            ]
        progress.advance(task, s.numel * 4)
        return version

    with ThreadPoolExecutor(max_workers=2 * len(set(addresses)), thread_name_prefix="export") as pool:
        seen = set(pool.map(fetch, plan)) or {low}
    if len(seen) > 1 and not allow_mixed:
        raise AdminError(
            f"model {model!r} was updated during the export (versions {min(seen)} to {max(seen)}); export between "
            "steps, when it is idle, or pass --allow-mixed-versions"
        )
    tensors = {p.name: flat.view(p.shape) for p, flat in zip(layouts, flats, strict=True)}
    versions = f"{min(seen)}" if len(seen) == 1 else f"{min(seen)}..{max(seen)}"
    return tensors, {"ps_offload.model": model, "ps_offload.version": versions}


@app.command()
def export(
    out: Annotated[Path, typer.Option(help="File to write.")],
    model: ModelOpt = None,
    file_format: Annotated[str, typer.Option("--format", help="File format: safetensors.")] = "safetensors",
    daemon: DaemonsOpt = None,
    allow_mixed_versions: Annotated[
        bool, typer.Option("--allow-mixed-versions", help="Export even if the shards are at different steps.")
    ] = False,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 600.0,
) -> None:
    """Write a model's current parameters, pulled from all its daemons, to a file."""
    if file_format not in EXPORT_FORMATS:
        _fail(f"unknown --format {file_format!r}; supported: {', '.join(EXPORT_FORMATS)}")
        raise typer.Exit(2)
    from safetensors import SafetensorError  # imported late: only export needs them
    from safetensors.torch import save_file

    if not out.parent.is_dir():  # before pulling a whole model
        _fail(f"cannot write {out}: {out.parent} is not a directory")
        raise typer.Exit(1)
    daemons = _unique(daemon)
    tmp = out.with_name(out.name + ".tmp")
    try:
        name = _resolve_model(daemons[0], model, timeout)
        with _progress(total_bytes=True) as progress:
            tensors, metadata = export_model(
                name, daemons, timeout=timeout, allow_mixed=allow_mixed_versions, progress=progress
            )
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(out)
    except AdminError as exc:
        _fail(str(exc))
        raise typer.Exit(1) from None
    except (OSError, SafetensorError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        _fail(f"cannot write {out}: {getattr(exc, 'strerror', None) or exc}")
        raise typer.Exit(1) from None
    numel = sum(t.numel() for t in tensors.values())
    row = {
        "model": name, "out": str(out), "format": file_format, "params": len(tensors), "numel": numel,
        "bytes": out.stat().st_size, "version": metadata["ps_offload.version"],
    }  # fmt: skip
    if as_json:
        _print_json(row)
    else:
        typer.echo(
            f"exported model {name!r} at version {row['version']}: {row['params']} parameters, {numel} elements, "
            f"{human_bytes(row['bytes'])} to {out}"
        )


# -- health ------------------------------------------------------------------------------


def check_health(address: str, service: str, timeout: float) -> dict[str, Any]:
    """grpc.health.v1 Check on one daemon: status name (or UNREACHABLE, ...) and latency."""
    started = time.perf_counter()
    try:
        with _channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        status, error = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status), ""
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        status = {
            grpc.StatusCode.UNAVAILABLE: "UNREACHABLE",
            grpc.StatusCode.DEADLINE_EXCEEDED: "NO_ANSWER",
            grpc.StatusCode.NOT_FOUND: "SERVICE_UNKNOWN",
            grpc.StatusCode.UNIMPLEMENTED: "NO_HEALTH_SERVICE",
        }.get(code, code.name)
        error = f"{code.name}: {exc.details()}"  # type: ignore[attr-defined]
    latency = time.perf_counter() - started
    return {"daemon": address, "status": status, "latency_ms": round(latency * 1000, 3), "error": error}


@app.command()
def health(
    daemon: DaemonsOpt = None,
    service: Annotated[str, typer.Option(help='Service to ask about ("": the daemon as a whole).')] = "",
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """Ask each daemon's grpc.health.v1 service. Exit 1 if any is not SERVING."""
    daemons = _unique(daemon)
    with ThreadPoolExecutor(max_workers=min(16, len(daemons))) as pool:
        rows = list(pool.map(lambda d: check_health(d, service, timeout), daemons))
    if as_json:
        _print_json(rows)
    else:
        table = Table("daemon", "status", "latency")
        for r in rows:
            serving = r["status"] == "SERVING"
            table.add_row(r["daemon"], r["status"], f"{r['latency_ms']:.1f} ms" if serving else "-")
        _console().print(table)
    unhealthy = [r for r in rows if r["status"] != "SERVING"]
    for r in unhealthy:
        why = f" ({r['error']})" if r["error"] else ""
        _fail(f"daemon {r['daemon']} is {r['status']}{why}")
    if unhealthy:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
