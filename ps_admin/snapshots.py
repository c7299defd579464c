"""`ps-admin snapshot take|list|delete|restore`: snapshots of a model across all its daemons.

take: every daemon of the model's plan (from its spec, as export finds them) snapshots its
shards at one step S (Admin.CreateSnapshot, in parallel: each answers when all its shards
have committed S). The step is S given, or the highest version any shard holds, so that a
model being trained is taken at the step in progress. If one daemon fails, the others'
parts are deleted again: a snapshot exists on all of a model's daemons or on none.

restore: a snapshot's master values and optimizer state, pulled from its daemons
(PullRequest.snapshot) or read from an export (snapshot_files.py), pushed as STATE into a
model registered afresh on the target daemons, possibly more or fewer of them and with another
shard size (the plan re-cut). The flat layout is the same, so each new shard gathers its
slices from the old shards (or parameters) that overlap it, a few held at a time: memory is a
few shards, not the model. Running it again after a failure finishes the job (a shard already
restored answers duplicate). The trainer then registers the same spec and resumes at step S.
The state carried: AdamW's exp_avg and exp_avg_sq, SGD's momentum buffer (none without
momentum), beside the master values.
"""

from __future__ import annotations

import bisect
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from rich.progress import Progress

from ps_offload.admin import client
from ps_offload.admin.client import AdminError, owners
from ps_offload.optimizers import state_tensors
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


def restore(
    model: str,
    name: str,
    sources: list[str],
    targets: list[str],
    *,
    new_name: str | None,
    shard_bytes: int | None,
    timeout: float,
    progress: Progress,
) -> dict[str, Any]:
    info, addresses = owners(model, sources, timeout)
    states = [tensor for _, tensor in state_tensors(info.spec)]
    step, sources = snapshot_sources(model, name, info, addresses, timeout)
    source = OldShards(model, name, plan_of(info.shards), sources, states, timeout)
    target = Target(info.spec, targets, new_name=new_name, shard_bytes=shard_bytes)
    row = restore_into(target, step, source, info.total_numel, len(states), timeout=timeout, progress=progress)
    return {"from": model, "snapshot": name, **row}


class Target:
    """Where a restore goes: the spec re-registered on `daemons` (as index 0, 1, ...), under
    `new_name` and with `shard_bytes` when given."""

    def __init__(self, spec: ps_pb2.ModelSpec, daemons: list[str], *, new_name: str | None, shard_bytes: int | None):
        self.spec = ps_pb2.ModelSpec()
        self.spec.CopyFrom(spec)
        self.spec.model = new_name or spec.model
        del self.spec.daemons[:]
        self.spec.daemons.extend(daemons)
        if shard_bytes is not None:
            self.spec.shard_bytes = shard_bytes
        self.daemons = daemons


def restore_into(
    target: Target, step: int, source, total_numel: int, states: int, *, timeout: float, progress: Progress
) -> dict[str, Any]:
    """Registers the target and pushes each of its shards' master and `states` state tensors
    at `step`, gathered by `source.copy_range(start, numel, tensor_index, out)`."""
    spec = target.spec
    plans = [plan_of(client.register(d, spec, i, timeout).shards) for i, d in enumerate(target.daemons)]
    if any(p != plans[0] for p in plans):
        raise AdminError(f"the target daemons computed different plans for {spec.model!r}: are they one release?")
    task = progress.add_task(f"restore {spec.model}", total=total_numel * 4 * (1 + states))
    restored = 0
    for new in sorted(plans[0], key=lambda s: s.offset):
        state = torch.empty((1 + states) * new.numel, dtype=torch.float32)
        for tensor_index in range(1 + states):
            into = state[tensor_index * new.numel : (tensor_index + 1) * new.numel]
            source.copy_range(new.offset, new.numel, tensor_index, into)
        data = memoryview(state.numpy()).cast("B")
        holders = [target.daemons[i] for i in new.holders]  # each replica of a replicated target
        restored += any([client.push_state(d, spec.model, new.shard_id, step, data, timeout) for d in holders])
        progress.advance(task, len(data))
    return {
        "model": spec.model, "step": step, "daemons": target.daemons, "shards": len(plans[0]),
        "shards_restored": restored, "bytes": total_numel * 4 * (1 + states),
    }  # fmt: skip


class OldShards:
    """The snapshot's shards in offset order, each pulled once when first needed and dropped
    once the new plan has passed it."""

    def __init__(self, model, name, plan: list[ShardSlice], sources: dict[int, str], states, timeout) -> None:
        plan = sorted(plan, key=lambda s: s.offset)
        self.model, self.name, self.plan = model, name, plan
        self.sources, self.tensors, self.timeout = sources, (ps_pb2.MASTER, *states), timeout
        self.offsets = [s.offset for s in plan]
        self.held: dict[int, tuple[ShardSlice, list[torch.Tensor]]] = {}  # shard id -> its tensors

    def _tensors(self, s: ShardSlice) -> list[torch.Tensor]:
        if s.shard_id not in self.held:
            pulled = []
            for tensor in self.tensors:
                request = ps_pb2.PullRequest(model=self.model, shard_id=s.shard_id, tensor=tensor, snapshot=self.name)
                data, _ = client.pull(self.sources[s.shard_id], request, s.numel, self.timeout)
                pulled.append(torch.frombuffer(data, dtype=torch.float32))
            self.held[s.shard_id] = (s, pulled)
        return self.held[s.shard_id][1]

    def copy_range(self, start: int, numel: int, tensor_index: int, out: torch.Tensor) -> None:
        """Copies elements [start, start + numel) of the flat `tensor_index` tensor into `out`."""
        end = start + numel
        for shard_id in [i for i, (s, _) in self.held.items() if s.offset + s.numel <= start]:
            del self.held[shard_id]  # the new plan goes forward: never needed again
        at = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        for s in self.plan[at:]:
            if s.offset >= end:
                break
            lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
            out[lo - start : hi - start] = self._tensors(s)[tensor_index][lo - s.offset : hi - s.offset]
