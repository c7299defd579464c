"""`ps-admin snapshot take|list|delete`: snapshots of a model across all its daemons, and
where a restore or an export reads each shard of one from (snapshot_sources).

take: every daemon of the model's plan (from its spec, as export finds them) snapshots its
shards at one step S (Admin.CreateSnapshot, in parallel: each answers when all its shards
have committed S). The step is S given, or the highest version any shard holds, so that a
model being trained is taken at the step in progress. If one daemon fails, the others'
parts are deleted again: a snapshot exists on all of a model's daemons or on none.

Nothing here loads torch (snapshot_restore.py does): take, list and delete answer in the
~0.6 s of every other ps-admin command, not the ~3 s of torch's import.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ps_offload.admin import client
from ps_offload.admin.client import AdminError, owners
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice


def plan_of(shards) -> list[ShardSlice]:
    return [ShardSlice(s.shard_id, s.daemon_index, s.offset, s.numel, tuple(s.holders[1:])) for s in shards]


def _holders(shard: ps_pb2.ShardPlacement) -> list[int]:
    return list(shard.holders) or [shard.daemon_index]


def owning(info: ps_pb2.ModelInfo, addresses: list[str]) -> list[str]:
    """Every daemon holding a shard of the model: its primaries and, replicated, their replicas."""
    return [addresses[i] for i in sorted({i for s in info.shards for i in _holders(s)})]


def uncovered(info: ps_pb2.ModelInfo, addresses: list[str], having: set[str]) -> list[int]:
    """The shards none of whose holders is in `having`."""
    return [s.shard_id for s in info.shards if not any(addresses[i] in having for i in _holders(s))]


def _stale(info: ps_pb2.ModelInfo, addresses: list[str], shards: dict[str, dict[int, int]]) -> dict[str, str]:
    """Holders two or more steps behind another holder of the same shard: left out by the trainer
    (a lost daemon come back with its old copy), so they never reach the step being taken.
    One step behind is a step in flight, and is waited for."""
    stale = {}
    for s in info.shards:
        held = {addresses[i]: shards[addresses[i]].get(s.shard_id) for i in _holders(s) if addresses[i] in shards}
        newest = max((v for v in held.values() if v is not None), default=0)
        for daemon, version in held.items():
            if daemon not in stale and (version is None or version < newest - 1):
                stale[daemon] = f"left out: shard {s.shard_id} at version {version}, behind {newest}"
    return stale


def take(model: str, name: str, daemons: list[str], step: int | None, timeout: float) -> list[dict[str, Any]]:
    """Of a replicated model, a holder that does not answer or is left out is passed over (and
    shown as not taken) as long as every shard has a holder that takes it."""
    info, addresses = owners(model, daemons, timeout)
    holders = owning(info, addresses)
    replicated = info.spec.replicas > 1
    versions: dict[str, dict[int, int]] = {}
    failures: dict[str, str] = {}
    for d in holders:
        try:
            versions[d] = {s.shard_id: s.version for s in client.list_shards(d, model, timeout)}
        except AdminError as exc:
            if not replicated:
                raise
            failures[d] = str(exc)
    if step is None:
        step = max((v for held in versions.values() for v in held.values()), default=0)
    if replicated:
        failures.update(_stale(info, addresses, versions))
    asked = [d for d in holders if d not in failures]
    with ThreadPoolExecutor(max_workers=max(len(asked), 1)) as pool:
        futures = {d: pool.submit(client.create_snapshot, d, model, name, step, timeout) for d in asked}
    taken = {}
    for daemon, future in futures.items():
        try:
            taken[daemon] = future.result()
        except AdminError as exc:
            failures[daemon] = str(exc)
    short = uncovered(info, addresses, set(taken))
    whole = not failures or (replicated and not short)
    problems = [] if whole else list(failures.values())
    if short:
        problems.insert(0, f"no holder of shards {short} took the snapshot")
    for daemon in asked:  # all or none: a part a failed create left behind, and every part if not whole
        if daemon in taken and whole:
            continue
        try:
            client.delete_snapshot(daemon, model, name, timeout)
        except AdminError as exc:
            if daemon in taken:
                problems.append(f"{exc} (delete it there by hand)")
    if not whole:
        raise AdminError("; ".join(problems))
    return [_row(d, model, taken[d]) if d in taken else _missing(d, model, name, failures[d]) for d in holders]


def _row(daemon: str, model: str, snap: ps_pb2.SnapshotInfo) -> dict[str, Any]:
    return {
        "daemon": daemon, "model": model, "name": snap.name, "step": snap.step, "shards": snap.shards,
        "bytes": snap.bytes, "complete": snap.complete, "damaged": snap.damaged or None, "created": snap.created_unix,
    }  # fmt: skip


def _missing(daemon: str, model: str, name: str, why: str) -> dict[str, Any]:
    """A holder of a replicated model passed over: its shards are in the snapshot from others."""
    return {
        "daemon": daemon, "model": model, "name": name, "step": None, "shards": 0, "bytes": 0,
        "complete": False, "damaged": None, "created": None, "missing": why,
    }  # fmt: skip


def _each_holder(info, addresses, call) -> list[dict[str, Any]]:
    """call(daemon) -> rows on every holder; of a replicated model a holder that fails gives a
    `missing` row instead of failing the command."""
    rows = []
    for d in owning(info, addresses):
        try:
            rows.extend(call(d))
        except AdminError as exc:
            if info.spec.replicas <= 1:
                raise
            rows.append(_missing(d, info.spec.model, "-", str(exc)))
    return rows


def listing(model: str, daemons: list[str], timeout: float) -> list[dict[str, Any]]:
    info, addresses = owners(model, daemons, timeout)
    return _each_holder(
        info, addresses, lambda d: [_row(d, model, snap) for snap in client.list_snapshots(d, model, timeout)]
    )


def delete(model: str, name: str, daemons: list[str], timeout: float) -> list[dict[str, Any]]:
    info, addresses = owners(model, daemons, timeout)
    return _each_holder(info, addresses, lambda d: [_row(d, model, client.delete_snapshot(d, model, name, timeout))])


def snapshot_sources(
    model: str, name: str, info: ps_pb2.ModelInfo, addresses: list[str], timeout: float
) -> tuple[int, dict[int, str]]:
    """The snapshot's step, and the daemon to read each shard of it from: its holder (of a
    replicated model the first of its holders) holding the snapshot complete and undamaged."""
    found: dict[str, ps_pb2.SnapshotInfo | str] = {}

    def on(daemon: str) -> ps_pb2.SnapshotInfo | str:
        if daemon not in found:
            try:
                snap = {s.name: s for s in client.list_snapshots(daemon, model, timeout)}.get(name)
            except AdminError as exc:
                snap = str(exc)
            if isinstance(snap, ps_pb2.SnapshotInfo) and (not snap.complete or snap.damaged):
                snap = snap.damaged or "is still taking it"
            found[daemon] = snap if snap is not None else "has no such snapshot"
        return found[daemon]

    sources = {}
    for shard in info.shards:
        why = []
        for index in _holders(shard):
            snap = on(addresses[index])
            if isinstance(snap, ps_pb2.SnapshotInfo):
                sources[shard.shard_id] = addresses[index]
                break
            why.append(f"daemon {addresses[index]} {snap}")
        else:
            raise AdminError(f"snapshot {name!r} of model {model!r}: " + "; ".join(why))
    steps = {found[d].step for d in set(sources.values())}
    if len(steps) != 1:
        raise AdminError(f"snapshot {name!r} of model {model!r} is at different steps on its daemons: {sorted(steps)}")
    return steps.pop(), sources
