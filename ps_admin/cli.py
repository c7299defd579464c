"""`ps-admin`: an operator's view of running ps-daemons, over the Admin service.

    ps-admin models   [--daemon ADDR ...] [--json]
    ps-admin shards   [--model NAME] [--daemon ADDR ...] [--tier T] [--param TEXT] [--sort KEY] [--json]
    ps-admin shard ID [--model NAME] [--daemon ADDR] [--bins N] [--json]
    ps-admin stats    [--daemon ADDR ...] [--interval SECONDS] [--json]
    ps-admin verify   [--model NAME] [--daemon ADDR ...] [--json]
    ps-admin export   --out FILE [--model NAME] [--format safetensors] [--daemon ADDR ...] [--json]
    ps-admin health   [--daemon ADDR ...] [--json]
    ps-admin evict ID... / prefetch ID... [--model NAME] [--daemon ADDR]
    ps-admin drop MODEL [--daemon ADDR ...] [--yes]
    ps-admin snapshot take|list|delete|restore ...   (snapshot_cli.py)
    ps-admin replicas MODEL [--daemon ADDR ...] [--json]   (replicas.py)

The commands only: calls are in client.py, dicts and tables in views.py, the export in
export.py. A failed RPC becomes one line on stderr and exit code 1; usage errors exit 2.
Progress bars of the long commands (verify, export) go to stderr, and only when it is a
terminal.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.progress import Progress

from ps_offload.admin import client, views
from ps_offload.admin.client import AdminError
from ps_offload.admin.options import (
    DEFAULT_DAEMON,
    DaemonOpt,
    DaemonsOpt,
    JsonOpt,
    ModelOpt,
    ShardIds,
    TimeoutOpt,
    fail,
    unique_daemons,
)
from ps_offload.admin.replicas import replicas_command
from ps_offload.admin.snapshot_cli import snapshot_app
from ps_offload.admin.views import SortKey, Tier
from ps_offload.proto import ps_pb2
from ps_offload.proto.security import ClientSecurity
from ps_offload.version import version_option

T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect running ps-daemons.")
app.add_typer(snapshot_app, name="snapshot")
app.command("replicas")(replicas_command)


def _each_daemon(daemons: list[str], fetch: Callable[[str], T]) -> tuple[list[tuple[str, T]], bool]:
    """Asks every daemon; one that fails is reported and skipped, so one dead daemon does
    not hide the others. Returns the answers and whether any failed."""
    answers, failed = [], False
    for daemon in daemons:
        try:
            answers.append((daemon, fetch(daemon)))
        except AdminError as exc:
            fail(str(exc))
            failed = True
    return answers, failed


@app.callback()
def main(
    show_version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=version_option("ps-admin"), help="Print the version."),
    ] = False,
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
    try:
        security = ClientSecurity(
            ca_file=ca_file or "", cert_file=cert_file or "", key_file=key_file or "",
            token_file=token_file or "", server_name=server_name or "",
        )  # fmt: skip
        security.token()  # a token file that cannot be read is one line now, not per call
    except ValueError as exc:
        fail(str(exc).removeprefix("ClientSecurity: "))
        raise typer.Exit(1) from None
    client.use_security(security)


@app.command()
def models(daemon: DaemonsOpt = None, as_json: JsonOpt = False, timeout: TimeoutOpt = 10.0) -> None:
    """List the models each daemon holds: spec, plan, optimizer; and each daemon's release."""
    daemons = unique_daemons(daemon)
    answers, failed = _each_daemon(daemons, lambda d: client.list_models_answer(d, timeout))
    if not answers:
        raise typer.Exit(1)
    rows = [
        {**views.model_to_dict(info, d), "daemon_version": answer.daemon_version, "protocol": answer.protocol}
        for d, answer in answers
        for info in answer.models
    ]
    if as_json:
        views.print_json(rows)
    else:
        out = views.console()
        out.print(views.models_table(rows))
        for d, answer in answers:  # also for a daemon holding no model
            out.print(f"{d}: ps-offload {answer.daemon_version or '(before 0.1.0)'}, protocol {answer.protocol}")
    if failed:
        raise typer.Exit(1)


@app.command()
def shards(
    model: ModelOpt = None,
    daemon: DaemonsOpt = None,
    tier: Annotated[Optional[Tier], typer.Option(help="Only shards in this tier.")] = None,
    param: Annotated[Optional[str], typer.Option(help="Only shards holding a parameter whose name has this.")] = None,
    sort: Annotated[Optional[SortKey], typer.Option(help="Order by this (default: as listed).")] = None,
    reverse: Annotated[bool, typer.Option("--reverse", help="Reverse the order.")] = False,
    as_map: Annotated[
        bool, typer.Option("--map", help="A glyph per shard, per model and daemon, instead of a table.")
    ] = False,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """List the shards each daemon holds (--map: where they live, at a glance)."""
    daemons = unique_daemons(daemon)
    answers, failed = _each_daemon(daemons, lambda d: client.list_shards(d, model or "", timeout))
    if not answers:  # nothing to show; the errors are on stderr
        raise typer.Exit(1)
    rows = [views.shard_to_dict(info, d) for d, infos in answers for info in infos]
    rows = views.select_shards(rows, tier=tier, param=param, sort=sort, reverse=reverse)
    if as_json:
        views.print_json(rows)
    elif as_map:
        for line in views.shard_map(rows):
            views.console().print(line)
    else:
        views.console().print(views.shards_table(rows, daemons))
    if failed:
        raise typer.Exit(1)


@app.command(context_settings={"ignore_unknown_options": True})  # `shard -1`: a bad id, not an option
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
        model = client.resolve_model(address, model, timeout)
        info = client.get_shard(address, model, shard_id, bins, timeout)
    except AdminError as exc:
        fail(str(exc))
        raise typer.Exit(1) from None
    row = views.shard_to_dict(info, address, values=True)
    if as_json:
        views.print_json(row)
        return
    console = views.console()
    for table in views.shard_tables(row):
        console.print(table)


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

    def sample(d: str) -> dict[str, Any]:
        return views.stats_to_dict(client.stats(d, timeout), d)

    daemons = unique_daemons(daemon)
    answers, failed = _each_daemon(daemons, sample)
    if interval:
        time.sleep(interval)
        firsts = dict(answers)
        later, failed_later = _each_daemon(list(firsts), sample)
        answers, failed = [], failed or failed_later
        for d, last in later:
            if last["uptime_seconds"] < firsts[d]["uptime_seconds"]:
                fail(f"daemon {d} restarted during the {interval:g} s interval")
                failed = True
            else:
                answers.append((d, {**last, **views.rates(last, firsts[d])}))
    else:
        answers = [(d, {**row, **views.rates(row)}) for d, row in answers]
    if not answers:
        raise typer.Exit(1)
    rows = [row for _, row in answers]
    if as_json:
        views.print_json(rows[0] if len(daemons) == 1 else rows)
    else:
        views.console().print(views.stats_table(rows))
    if failed:
        raise typer.Exit(1)


def _move(
    verb: str, shard_ids: list[int], model: str | None, daemon: str | None, timeout: float, as_json: bool
) -> None:
    """evict / prefetch: one RPC per shard, one line (or JSON row) per shard, exit 1 if any failed."""
    address = daemon or DEFAULT_DAEMON
    failed = False
    try:
        model = client.resolve_model(address, model, timeout)
    except AdminError as exc:
        fail(str(exc))
        raise typer.Exit(1) from None
    rows = []
    for shard_id in shard_ids:
        try:
            answer = client.move(address, verb, model, shard_id, timeout)
        except AdminError as exc:
            fail(str(exc))
            failed = True
            continue
        rows.append({"daemon": address, "model": model, "shard_id": shard_id, "tier": answer.tier})
        if not as_json:
            typer.echo(f"shard {shard_id}: {answer.tier}")
    if as_json:
        views.print_json(rows)
    if failed:
        raise typer.Exit(1)


@app.command(context_settings={"ignore_unknown_options": True})
def evict(
    shard_ids: ShardIds, model: ModelOpt = None, daemon: DaemonOpt = None, as_json: JsonOpt = False,
    timeout: TimeoutOpt = 10.0,
) -> None:  # fmt: skip
    """Drop shards from the RAM tier; they stay committed on NVMe."""
    _move("evict", shard_ids, model, daemon, timeout, as_json)


@app.command(context_settings={"ignore_unknown_options": True})
def prefetch(
    shard_ids: ShardIds, model: ModelOpt = None, daemon: DaemonOpt = None, as_json: JsonOpt = False,
    timeout: TimeoutOpt = 60.0,
) -> None:  # fmt: skip
    """Read shards into the RAM tier now."""
    _move("prefetch", shard_ids, model, daemon, timeout, as_json)


def _verify_daemon(address: str, model: str, timeout: float, progress: Progress) -> dict[str, Any]:
    """Streams one daemon's Verify; returns its summary with every verdict under "shards"."""
    summary: dict[str, Any] = {"daemon": address}
    task = None

    def on_answer(answer: ps_pb2.VerifyResponse) -> None:
        nonlocal task
        if answer.HasField("plan"):
            summary.update(
                at_rest=answer.plan.at_rest,
                planned_bytes=answer.plan.bytes,
                damaged=dict(sorted(answer.plan.damaged.items())),
                shards=[],
            )
            task = progress.add_task(f"verify {address}", total=answer.plan.shards)
        else:
            summary["shards"].append(views.verdict_to_dict(answer.shard, address))
            progress.advance(task)

    client.verify(address, model, timeout, on_answer)
    verdicts = summary["shards"]
    for status in ("ok", "bad", "not_at_rest"):
        summary[status] = sum(v["status"] == status for v in verdicts)
    summary["bytes_read"] = sum(v["bytes_read"] for v in verdicts)
    return summary


@app.command()
def verify(
    model: ModelOpt = None, daemon: DaemonsOpt = None, as_json: JsonOpt = False, timeout: TimeoutOpt = 3600.0
) -> None:
    """Read every committed shard back from NVMe and check its crc32c. Exit 1 if any shard or
    model is bad (a model the daemon could not recover, or whose files would not bring it back
    at the next start)."""
    daemons = unique_daemons(daemon)
    with views.progress_bar() as progress:
        answers, failed = _each_daemon(daemons, lambda d: _verify_daemon(d, model or "", timeout, progress))
    summaries = [s for _, s in answers]
    bad = [v for s in summaries for v in s["shards"] if v["status"] == "bad"]
    damaged = [(s["daemon"], name, why) for s in summaries for name, why in s["damaged"].items()]
    if as_json:
        views.print_json({"bad": len(bad), "damaged_models": len(damaged), "daemons": summaries})
    else:
        console = views.console()
        for s in summaries:
            console.print(views.verify_line(s), highlight=False)
        if bad:
            console.print(views.bad_shards_table(bad))
    for v in bad:
        fail(f"shard {v['shard_id']} of model {v['model']!r} on daemon {v['daemon']} is bad: {v['detail']}")
    for address, name, why in damaged:
        fail(f"model {name!r} on daemon {address} is damaged: {why}")
    if failed or bad or damaged:
        raise typer.Exit(1)


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
    # Imported here: export loads torch, which costs every other command ~2 s of start-up.
    from ps_offload.admin.export import FORMATS as EXPORT_FORMATS
    from ps_offload.admin.export import export_file

    if file_format not in EXPORT_FORMATS:
        fail(f"unknown --format {file_format!r}; supported: {', '.join(EXPORT_FORMATS)}")
        raise typer.Exit(2)
    if not out.parent.is_dir():  # before pulling a whole model
        fail(f"cannot write {out}: {out.parent} is not a directory")
        raise typer.Exit(1)
    try:
        with views.progress_bar(total_bytes=True) as progress:
            name, tensors, metadata = export_file(
                out, model, unique_daemons(daemon), timeout=timeout, allow_mixed=allow_mixed_versions, progress=progress
            )
    except AdminError as exc:
        fail(str(exc))
        raise typer.Exit(1) from None
    row = {
        "model": name, "out": str(out), "format": file_format, "params": len(tensors),
        "numel": sum(t.numel() for t in tensors.values()), "bytes": out.stat().st_size,
        "version": metadata["ps_offload.version"],
    }  # fmt: skip
    if as_json:
        views.print_json(row)
    else:
        typer.echo(views.export_line(row))


@app.command()
def drop(
    model: Annotated[str, typer.Argument(help="Name of the model to delete.")],
    daemon: DaemonsOpt = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask (needed when stdin is not a terminal).")] = False,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 120.0,
    partial: Annotated[
        bool,
        typer.Option(
            "--partial", help="Drop it on the daemons named even though it spans others (e.g. one whose node is gone)."
        ),
    ] = False,
) -> None:
    """Delete a model from daemons for good: its parameters and optimizer state, in RAM and on NVMe.
    Every daemon the model spans must be named (else nothing is dropped), unless --partial."""
    daemons = unique_daemons(daemon)
    where = ", ".join(daemons)
    missing = [] if partial else _unnamed_daemons(model, daemons, timeout)
    if missing:
        fail(
            f"model {model!r} also has shards on {', '.join(missing)} (as its trainers named them), which "
            "--daemon does not name; nothing was dropped. Name every daemon of the model (its trainers could not "
            "register it again while a part of it is left), or pass --partial to drop only these"
        )
        raise typer.Exit(2)
    if not yes:
        if not sys.stdin.isatty():
            fail(f"drop deletes model {model!r} and all its state on {where}; pass --yes to do it")
            raise typer.Exit(2)
        typed = typer.prompt(f"This deletes model {model!r} and all its state on {where}. Type its name to confirm")
        if typed != model:
            fail("the name typed does not match; nothing was dropped")
            raise typer.Exit(1)
    answers, failed = _each_daemon(daemons, lambda d: client.drop_model(d, model, timeout))
    rows = [
        {"daemon": d, "model": model, "shards": a.shards, "ram_bytes": a.ram_bytes, "disk_bytes": a.disk_bytes,
         "was_damaged": a.was_damaged}
        for d, a in answers
    ]  # fmt: skip
    if as_json:
        views.print_json(rows)
    else:
        for row in rows:
            typer.echo(views.drop_line(row))
    if failed:
        raise typer.Exit(1)


def _unnamed_daemons(model: str, daemons: list[str], timeout: float) -> list[str]:
    """The daemons of the model's plan (as its trainers spelled them) that none of `daemons`
    is. Told by each daemon's index in the plan, not by name: an admin and a trainer may spell
    one daemon differently. A daemon that cannot say (down, damaged model) is left to the drop."""
    indices: set[int] = set()
    spanned: list[str] = []
    for address in daemons:
        try:
            info = client.get_model(address, model, timeout)
        except AdminError:
            continue
        indices.add(info.daemon_index)
        spanned = list(info.spec.daemons)
    return [name for index, name in enumerate(spanned) if index not in indices]


@app.command()
def health(
    daemon: DaemonsOpt = None,
    service: Annotated[str, typer.Option(help='Service to ask about ("": the daemon as a whole).')] = "",
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """Ask each daemon's grpc.health.v1 service. Exit 1 if any is not SERVING."""
    daemons = unique_daemons(daemon)
    with ThreadPoolExecutor(max_workers=min(16, len(daemons))) as pool:
        rows = list(pool.map(lambda d: client.check_health(d, service, timeout), daemons))
    if as_json:
        views.print_json(rows)
    else:
        views.console().print(views.health_table(rows))
    unhealthy = [r for r in rows if r["status"] != "SERVING"]
    for r in unhealthy:
        why = f" ({r['error']})" if r["error"] else ""
        fail(f"daemon {r['daemon']} is {r['status']}{why}")
    if unhealthy:
        raise typer.Exit(1)


@app.command("cluster-file")
def cluster_file_command(
    port: Annotated[int, typer.Option(min=1, max=65535, help="The daemons' port (their server.listen).")] = 50051,
    nodelist: Annotated[
        Optional[str], typer.Option(envvar="SLURM_JOB_NODELIST", help="Slurm node list, e.g. gpu[001-004].")
    ] = None,
    out: Annotated[Optional[Path], typer.Option(help="File to write (default: print it).")] = None,
) -> None:
    """Write a job's cluster file (one daemon per node, in plan order) from a Slurm node list:
    point $PS_CLUSTER_FILE at it for the trainers and ps-admin."""
    from ps_offload.admin import cluster_file

    if not nodelist:
        fail("no node list: give --nodelist, or run inside a Slurm job ($SLURM_JOB_NODELIST)")
        raise typer.Exit(2)
    try:
        daemons = cluster_file.daemons_of(nodelist, port)
        if out is None:
            typer.echo(cluster_file.text(daemons), nl=False)
        else:
            cluster_file.write(out, daemons)
    except AdminError as exc:
        fail(str(exc))
        raise typer.Exit(1) from None


if __name__ == "__main__":
    app()
