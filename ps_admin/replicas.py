"""`ps-admin replicas MODEL`: whether every shard of a replicated model (OffloadConfig.replicas)
is on all of its holders, from the daemons' own answers: each holder named by the model's
plan (ShardPlacement.holders, at the spec's addresses, or the --daemon given for its index) is
asked for the shard's version. A shard is degraded when a holder does not answer, no longer
holds the model (lost for good, or dropped), holds no values, or is at another version than
the newest of its holders (left out by the trainer, or stale). Between steps a healthy model
shows every holder of a shard at one version; during a step, holders may differ by one.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from ps_offload.admin import client, views
from ps_offload.admin.client import AdminError
from ps_offload.admin.options import DaemonsOpt, JsonOpt, TimeoutOpt, fail, unique_daemons
from ps_offload.proto import ps_pb2


def replica_report(model: str, daemons: list[str], timeout: float) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Per shard: its holders (address, version or None, why not) and whether it is degraded.
    Also each daemon that could not be asked, and why."""
    info, addresses = client.owners(model, daemons, timeout)
    versions: dict[str, dict[int, ps_pb2.ShardInfo] | str] = {}
    for address in sorted(set(addresses)):
        try:
            versions[address] = {s.shard_id: s for s in client.list_shards(address, model, timeout)}
        except AdminError as exc:
            versions[address] = str(exc)
    rows = []
    for shard in info.shards:
        holders = []
        for index in shard.holders or [shard.daemon_index]:
            address = addresses[index]
            answer = versions[address]
            held = answer.get(shard.shard_id) if isinstance(answer, dict) else None
            why = answer if isinstance(answer, str) else ("" if held else "does not hold it")
            if held is not None and not held.initialized:
                why = "holds no values"
            holders.append({"daemon": address, "version": held.version if held else None, "problem": why})
        newest = max((h["version"] for h in holders if h["version"] is not None), default=None)
        for h in holders:
            if not h["problem"] and h["version"] != newest:
                h["problem"] = f"at version {h['version']}, behind {newest}"
        problems = [f"{h['daemon']}: {h['problem']}" for h in holders if h["problem"]]
        rows.append({"shard_id": shard.shard_id, "holders": holders, "degraded": bool(problems), "problems": problems})
    unreachable = {a: v for a, v in versions.items() if isinstance(v, str)}
    return rows, unreachable


def replicas_command(
    model: Annotated[str, typer.Argument(help="The model.")],
    daemon: DaemonsOpt = None,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 30.0,
) -> None:
    """Whether every shard of a replicated model is on all its holders, at one version; exit 1
    if any is degraded (a holder lost, dropped, stale or not answering)."""
    try:
        rows, unreachable = replica_report(model, unique_daemons(daemon), timeout)
    except AdminError as exc:
        fail(str(exc))
        raise typer.Exit(1) from None
    degraded = [r for r in rows if r["degraded"]]
    if as_json:
        views.print_json({"shards": rows, "degraded": len(degraded), "unreachable": unreachable})
    else:
        table = Table("shard", "holders (version)", "state")
        for r in rows:
            versions = [(h["daemon"], "-" if h["version"] is None else h["version"]) for h in r["holders"]]
            holders = ", ".join(f"{address} ({version})" for address, version in versions)
            state = "; ".join(r["problems"]) if r["degraded"] else "ok"
            table.add_row(str(r["shard_id"]), holders, state, style="red" if r["degraded"] else None)
        out = views.console()
        out.print(table)
        out.print(f"{len(degraded)} of {len(rows)} shards degraded" if degraded else f"all {len(rows)} shards whole")
    if degraded:
        raise typer.Exit(1)
