"""What ps-admin shows: each response as a plain dict (`shard_to_dict`, `stats_to_dict`, ...),
and the tables and lines built from those dicts only.

`--json` prints the dicts as they are and the tables only format them, so the two views
cannot disagree. Nothing here makes a call.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from ps_offload.proto import ps_pb2

PARAMS_WIDTH = 40  # the params column shows "first +N more" past this many characters
BAR_WIDTH = 40  # characters of the longest histogram bar


class Tier(StrEnum):
    ram = "ram"
    nvme = "nvme"
    corrupt = "corrupt"


class SortKey(StrEnum):
    id = "id"
    version = "version"
    bytes = "bytes"
    tier = "tier"


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
    row: dict[str, Any] = {"daemon": daemon, **{f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}}
    row["clients"] = [
        {"client": c.client, "transport": c.transport, "connections": c.connections, "shared_bytes": c.shared_bytes}
        for c in stats.clients
    ]
    return row


def rates(last: dict[str, Any], first: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rates from stats_to_dict samples: between two (`first`, then `last`), or since the
    daemon started (`first` None), timed by the daemon's own uptime_seconds.

    prefetch_hit_rate: of the shards read from NVMe, the share read ahead of use (prefetched)
    rather than when a pull or push asked for it (a miss). A prefetched shard evicted before
    its use still counts as read ahead. ram_hit_rate: of all uses, the share that found the
    shard resident (a pull right after its push always does). None without NVMe reads.

    commits_per_group: how many shard versions one group commit (one pair of flushes) made
    durable on average; flushes_per_commit: the fdatasyncs each commit cost (2 when commits
    come one at a time; less as more share a group). None without commits."""

    def delta(key: str) -> float:
        return last[key] - (first[key] if first else 0)

    seconds = delta("uptime_seconds")
    per_second = (lambda key: delta(key) / seconds) if seconds > 0 else (lambda key: None)
    prefetched, misses, hits = delta("prefetched"), delta("tier_misses"), delta("tier_hits")
    commits, groups = delta("nvme_commits"), delta("nvme_commit_groups")
    return {
        "rates_since": "interval" if first else "start",
        "rates_seconds": seconds,
        "pushes_per_second": per_second("pushes_applied"),
        "pulls_per_second": per_second("pulls"),
        "bytes_in_per_second": per_second("bytes_pushed"),
        "bytes_out_per_second": per_second("bytes_pulled"),
        "prefetch_hit_rate": prefetched / (prefetched + misses) if prefetched + misses else None,
        "ram_hit_rate": hits / (hits + misses) if hits + misses else None,
        "commits_per_group": commits / groups if groups else None,
        "flushes_per_commit": delta("nvme_flushes") / commits if commits else None,
    }


def model_to_dict(info: ps_pb2.ModelInfo, daemon: str) -> dict[str, Any]:
    spec = info.spec
    optimizer = spec.optimizer.WhichOneof("kind")
    fields = getattr(spec.optimizer, optimizer) if optimizer else None
    return {
        "daemon": daemon,
        "model": spec.model,
        "damaged": info.damaged or None,  # why it could not be recovered; then nothing else is known
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


def cell(key: str, value: Any) -> str:
    """A dict value as a table cell; the key's name says its unit (bytes, _seconds, _rate)."""
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
        return "\n".join(_client_path(v) if isinstance(v, dict) else v for v in value)
    return str(value)


def _client_path(path: dict[str, Any]) -> str:
    """A StatsResponse.clients entry: who, over which path, how much."""
    count = "calls in the last minute" if path["transport"] == "grpc" else "connections"
    shared = f", {human_bytes(path['shared_bytes'])} shared" if path["shared_bytes"] else ""
    return f"{path['client']}: {path['transport']} ({path['connections']} {count}{shared})"


def bar(count: int, largest: int) -> str:
    """A text bar `count / largest` of BAR_WIDTH characters; a sliver for any count > 0."""
    if not count:
        return ""
    return "█" * max(1, round(BAR_WIDTH * count / largest)) if largest else ""


def console() -> Console:
    """The console tables print to (stdout)."""
    # Piped output (grep, less) would otherwise be cut to 80 columns and tables would fold
    # names mid-word; tables only take the width they need, so a wide limit costs nothing.
    out = Console()
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(width=400)
    return out


def print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, allow_nan=False))


@contextlib.contextmanager
def progress_bar(*, total_bytes: bool = False) -> Iterator[Progress]:
    """A progress bar on stderr, shown only when stderr is a terminal (so --json and piped
    output stay clean)."""
    err = Console(stderr=True)
    count = DownloadColumn(binary_units=True) if total_bytes else MofNCompleteColumn()
    columns = [TextColumn("{task.description}"), BarColumn(), count, TimeRemainingColumn()]
    with Progress(*columns, console=err, disable=not err.is_terminal, transient=True) as progress:
        yield progress


# -- tables and lines --------------------------------------------------------------------


def models_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("daemon", "model", "index", "params", "numel", "shards here", "shard bytes", "optimizer")
    for r in rows:
        if r["damaged"]:
            table.add_row(r["daemon"], r["model"], "DAMAGED", "-", "-", "-", "-", r["damaged"], style="red")
            continue
        o = r["optimizer"] or {}
        optimizer = f"{o.get('type')} lr={o.get('lr', 0):g}" if o else "-"
        table.add_row(
            r["daemon"], r["model"], f"{r['daemon_index']} of {len(r['daemons'])}", str(len(r["params"])),
            str(r["numel"]), f"{r['shards_here']} of {r['shards']}", human_bytes(r["shard_bytes"]), optimizer,
        )  # fmt: skip
    return table


def shards_table(rows: list[dict[str, Any]], daemons: list[str]) -> Table:
    multi = len(daemons) > 1  # a daemon column only where there is a choice of daemon
    table = Table(title=None if multi else f"shards on {daemons[0]}")
    # "in RAM": the bytes resident now (0 on NVMe only, as after a restart: nothing is lost).
    for name in ["daemon"] * multi + ["shard", "model", "parameters", "numel", "in RAM", "tier", "version"]:
        table.add_column(name, justify="right" if name in ("shard", "numel", "in RAM", "version") else "left")
    table.add_column("initialized")
    for r in rows:
        cells = [str(r["shard_id"]), r["model"], short_params(r["params"]), str(r["numel"])]
        cells += [human_bytes(r["bytes"]), r["tier"], str(r["version"]), "yes" if r["initialized"] else "no"]
        table.add_row(*[r["daemon"]] * multi, *cells)
    return table


# One glyph per shard in `ps-admin shards --map`: readable without colour, coloured on a terminal.
MAP_GLYPHS = {"ram": ("R", "green"), "nvme": ("n", "blue"), "corrupt": ("X", "bold red")}
MAP_WIDTH = 64


def shard_map(rows: list[dict[str, Any]]) -> list[Text]:
    """Where a model's shards live at a glance: per model and daemon, one glyph per shard in id
    order (R in RAM, n on NVMe only, X corrupt, ? anything else), MAP_WIDTH to a line."""
    lines = [Text("R ram  n nvme  X corrupt  (one per shard, in shard id order)", style="dim")]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["daemon"]), []).append(r)
    for (model, daemon), shards in sorted(groups.items()):
        shards.sort(key=lambda r: r["shard_id"])
        counts = ", ".join(f"{sum(s['tier'] == t for s in shards)} {t}" for t in sorted({s["tier"] for s in shards}))
        lines.append(Text(f"{model} on {daemon}: {len(shards)} shards ({counts})", style="bold"))
        for start in range(0, len(shards), MAP_WIDTH):
            line = Text(f"  {shards[start]['shard_id']:>6} ")
            for s in shards[start : start + MAP_WIDTH]:
                glyph, style = MAP_GLYPHS.get(s["tier"], ("?", "yellow"))
                line.append(glyph, style=style)
            lines.append(line)
    return lines


def shard_tables(row: dict[str, Any]) -> tuple[Table, Table]:
    """A shard_to_dict(values=True) row: its fields, and the histogram with a bar per bin."""
    table = Table("field", "value")
    for key, value in row.items():
        if key != "histogram":
            table.add_row(key, cell(key, value))
    edges, counts = row["histogram"]["edges"], row["histogram"]["counts"]
    histogram = Table("from", "to", "count", "", title="finite master values")
    for i, count in enumerate(counts):
        histogram.add_row(f"{edges[i]:.4g}", f"{edges[i + 1]:.4g}", str(count), bar(count, max(counts)))
    return table, histogram


def stats_table(rows: list[dict[str, Any]]) -> Table:
    """One column per daemon, one row per field."""
    table = Table("field", *(r["daemon"] for r in rows))
    for key in [k for k in rows[0] if k != "daemon"]:
        table.add_row(key, *(cell(key, r[key]) for r in rows))
    return table


def verify_line(s: dict[str, Any]) -> str:
    """One daemon's verify summary in a sentence."""
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
    if s["damaged"]:
        n = len(s["damaged"])
        line += f"; {n} model{'s' * (n != 1)} DAMAGED ({', '.join(map(repr, s['damaged']))})"
    return line


def bad_shards_table(bad: list[dict[str, Any]]) -> Table:
    table = Table("daemon", "model", "shard", "version", "tier", "why", title="bad shards")
    for v in bad:
        table.add_row(v["daemon"], v["model"], str(v["shard_id"]), str(v["version"]), v["tier"], v["detail"])
    return table


def export_line(row: dict[str, Any]) -> str:
    return (
        f"exported model {row['model']!r} at version {row['version']}: {row['params']} parameters, "
        f"{row['numel']} elements, {human_bytes(row['bytes'])} to {row['out']}"
    )


def drop_line(row: dict[str, Any]) -> str:
    if row["was_damaged"]:
        deleted = human_bytes(row["disk_bytes"])
        return f"dropped damaged model {row['model']!r} on {row['daemon']}: {deleted} of files deleted"
    return (
        f"dropped model {row['model']!r} on {row['daemon']}: {row['shards']} shards, "
        f"{human_bytes(row['ram_bytes'])} of RAM and {human_bytes(row['disk_bytes'])} on disk freed"
    )


def health_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("daemon", "status", "latency")
    for r in rows:
        serving = r["status"] == "SERVING"
        table.add_row(r["daemon"], r["status"], f"{r['latency_ms']:.1f} ms" if serving else "-")
    return table
