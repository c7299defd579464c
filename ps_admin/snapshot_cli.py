"""`ps-admin snapshot ...`: snapshots of a model on its daemons' NVMe tiers (snapshots.py
does the work; ps_daemon/tiers/snapshot_pins.py says how a daemon keeps one without a copy).

    ps-admin snapshot take MODEL NAME [--step S] [--daemon ADDR ...]
    ps-admin snapshot list MODEL [--daemon ADDR ...]
    ps-admin snapshot delete MODEL NAME [--daemon ADDR ...]
    ps-admin snapshot restore MODEL NAME --to ADDR [--to ADDR ...] [--as NEW] [--shard-bytes N] [--daemon ADDR ...]
    ps-admin snapshot export MODEL NAME --out DIR [--part-bytes N] [--daemon ADDR ...]
    ps-admin snapshot restore MODEL NAME --from DIR --to ADDR [--to ADDR ...] [--as NEW] [--shard-bytes N]
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from ps_offload.admin import views
from ps_offload.admin.client import AdminError
from ps_offload.admin.options import DaemonsOpt, JsonOpt, TimeoutOpt, fail, unique_daemons

snapshot_app = typer.Typer(no_args_is_help=True, help="Snapshots of a model at one step, and restoring them.")

ModelArg = Annotated[str, typer.Argument(help="The model.")]
NameArg = Annotated[str, typer.Argument(help="The snapshot's name (A-Z a-z 0-9 . _ -).")]


def _work():
    """snapshots.py (take, list, delete), imported when a command runs."""
    from ps_offload.admin import snapshots

    return snapshots


def _restore():
    """snapshot_restore.py, imported late: it loads torch (~3 s of start-up), which take, list
    and delete do not pay."""
    from ps_offload.admin import snapshot_restore

    return snapshot_restore


def _files():
    """snapshot_files.py (export, restore --from), imported late for the same reason."""
    from ps_offload.admin import snapshot_files

    return snapshot_files


def _run(call) -> Any:
    try:
        return call()
    except AdminError as exc:
        fail(str(exc))
        raise typer.Exit(1) from None


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table("daemon", "model", "snapshot", "step", "shards", "disk", "state")
    for r in rows:
        state = "DAMAGED: " + r["damaged"] if r["damaged"] else ("complete" if r["complete"] else "being taken")
        if r.get("missing"):  # a replica's holder passed over: the others hold its shards
            state = "not on this holder: " + r["missing"]
        step = "-" if r["step"] is None else str(r["step"])
        table.add_row(
            r["daemon"], r["model"], r["name"], step, str(r["shards"]), views.human_bytes(r["bytes"]), state,
            style="red" if r["damaged"] else ("yellow" if r.get("missing") else None),
        )  # fmt: skip
    return table


def _show(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        views.print_json(rows)
    else:
        views.console().print(_table(rows))


@snapshot_app.command()
def take(
    model: ModelArg,
    name: NameArg,
    step: Annotated[
        Optional[int], typer.Option(min=0, help="The step to take (default: the highest any shard is at).")
    ] = None,
    daemon: DaemonsOpt = None,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 600.0,
) -> None:
    """Snapshot a model at one step on all its daemons, while it trains (no copy of the state)."""
    _show(_run(lambda: _work().take(model, name, unique_daemons(daemon), step, timeout)), as_json)


@snapshot_app.command("list")
def list_(model: ModelArg, daemon: DaemonsOpt = None, as_json: JsonOpt = False, timeout: TimeoutOpt = 10.0) -> None:
    """List a model's snapshots on each of its daemons."""
    _show(_run(lambda: _work().listing(model, unique_daemons(daemon), timeout)), as_json)


@snapshot_app.command()
def delete(
    model: ModelArg, name: NameArg, daemon: DaemonsOpt = None, as_json: JsonOpt = False, timeout: TimeoutOpt = 60.0
) -> None:
    """Delete a snapshot on all the model's daemons; its disk goes back to the model's file."""
    _show(_run(lambda: _work().delete(model, name, unique_daemons(daemon), timeout)), as_json)


@snapshot_app.command()
def restore(
    model: ModelArg,
    name: NameArg,
    to: Annotated[list[str], typer.Option("--to", help="A daemon to restore onto (repeat: the new daemon list).")],
    as_name: Annotated[Optional[str], typer.Option("--as", help="Name of the restored model (default: MODEL).")] = None,
    shard_bytes: Annotated[
        Optional[int], typer.Option(min=4096, help="fp32 bytes per shard of the restored model (default: the same).")
    ] = None,
    from_dir: Annotated[
        Optional[Path], typer.Option("--from", help="An export's directory (snapshot export) instead of the daemons.")
    ] = None,
    daemon: DaemonsOpt = None,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 600.0,
) -> None:
    """Restore a snapshot into a model registered afresh on the --to daemons (any number: the
    plan is cut again), from its daemons or from an export (--from DIR, checked first).
    Training resumes there at the snapshot's step. Run it again after a failure to finish it."""
    targets = list(dict.fromkeys(to))
    options = dict(new_name=as_name, shard_bytes=shard_bytes, timeout=timeout)
    with views.progress_bar(total_bytes=True) as progress:
        if from_dir is not None:
            row = _run(lambda: _files().restore_from(from_dir, model, name, targets, progress=progress, **options))
        else:
            sources = unique_daemons(daemon)
            row = _run(lambda: _restore().restore(model, name, sources, targets, progress=progress, **options))
    if as_json:
        views.print_json(row)
    else:
        typer.echo(
            f"restored snapshot {row['snapshot']!r} of {row['from']!r} at step {row['step']} as model "
            f"{row['model']!r} on {len(row['daemons'])} daemons: {row['shards']} shards "
            f"({row['shards_restored']} written now), {views.human_bytes(row['bytes'])}"
        )


@snapshot_app.command()
def export(
    model: ModelArg,
    name: NameArg,
    out: Annotated[Path, typer.Option("--out", help="Directory to write (shared storage); created if missing.")],
    part_bytes: Annotated[
        int, typer.Option(min=4096, help="About this many fp32 bytes of parameters per file (default 1 GiB).")
    ] = 1 << 30,
    daemon: DaemonsOpt = None,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 600.0,
) -> None:
    """Copy a snapshot off its daemons into a directory: safetensors files per parameter (master
    values and optimizer state) and a manifest, readable by torch, restorable onto any daemons
    with `snapshot restore --from DIR`. Run it again after an interruption: it keeps what it wrote."""
    with views.progress_bar(total_bytes=True) as progress:
        row = _run(
            lambda: _files().export(
                model, name, unique_daemons(daemon), out, part_bytes=part_bytes, timeout=timeout, progress=progress
            )
        )
    if as_json:
        views.print_json(row)
    else:
        typer.echo(
            f"exported snapshot {row['snapshot']!r} of {row['model']!r} at step {row['step']} to {row['out']}: "
            f"{row['files']} files in {row['parts']} parts ({row['parts_written']} written now), "
            f"{views.human_bytes(row['bytes'])}"
        )
