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
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.proto.push import state_tensors


def plan_of(shards) -> list[ShardSlice]:
    return [ShardSlice(s.shard_id, s.daemon_index, s.offset, s.numel) for s in shards]


def owning(info: ps_pb2.ModelInfo, addresses: list[str]) -> list[str]:
    return [addresses[i] for i in sorted({s.daemon_index for s in info.shards})]


def take(model: str, name: str, daemons: list[str], step: int | None, timeout: float) -> list[dict[str, Any]]:
    info, addresses = owners(model, daemons, timeout)
    holders = owning(info, addresses)
    if step is None:
        versions = [s.version for d in holders for s in client.list_shards(d, model, timeout)]
        step = max(versions, default=0)
    with ThreadPoolExecutor(max_workers=len(holders)) as pool:
        futures = {d: pool.submit(client.create_snapshot, d, model, name, step, timeout) for d in holders}
    taken, failures = {}, []
    for daemon, future in futures.items():
        try:
            taken[daemon] = future.result()
        except AdminError as exc:
            failures.append(str(exc))
    if failures:
        for daemon in taken:  # all or none
            try:
                client.delete_snapshot(daemon, model, name, timeout)
            except AdminError as exc:
                failures.append(f"{exc} (delete it there by hand)")
        raise AdminError("; ".join(failures))
    return [_row(d, model, taken[d]) for d in holders]


def _row(daemon: str, model: str, snap: ps_pb2.SnapshotInfo) -> dict[str, Any]:
    return {
        "daemon": daemon, "model": model, "name": snap.name, "step": snap.step, "shards": snap.shards,
        "bytes": snap.bytes, "complete": snap.complete, "damaged": snap.damaged or None, "created": snap.created_unix,
    }  # fmt: skip


def listing(model: str, daemons: list[str], timeout: float) -> list[dict[str, Any]]:
    info, addresses = owners(model, daemons, timeout)
    return [_row(d, model, s) for d in owning(info, addresses) for s in client.list_snapshots(d, model, timeout)]


def delete(model: str, name: str, daemons: list[str], timeout: float) -> list[dict[str, Any]]:
    info, addresses = owners(model, daemons, timeout)
    return [_row(d, model, client.delete_snapshot(d, model, name, timeout)) for d in owning(info, addresses)]


def snapshot_step(model: str, name: str, owning: list[str], timeout: float) -> int:
    steps = set()
    for daemon in owning:
        found = {s.name: s for s in client.list_snapshots(daemon, model, timeout)}.get(name)
        if found is None or not found.complete or found.damaged:
            why = "has no such snapshot" if found is None else found.damaged or "is still taking it"
            raise AdminError(f"snapshot {name!r} of model {model!r}: daemon {daemon} {why}")
        steps.add(found.step)
    if len(steps) != 1:
        raise AdminError(f"snapshot {name!r} of model {model!r} is at different steps on its daemons: {sorted(steps)}")
    return steps.pop()


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
    step = snapshot_step(model, name, owning(info, addresses), timeout)
    source = OldShards(model, name, plan_of(info.shards), addresses, states, timeout)
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
        restored += client.push_state(target.daemons[new.daemon_index], spec.model, new.shard_id, step, data, timeout)
        progress.advance(task, len(data))
    return {
        "model": spec.model, "step": step, "daemons": target.daemons, "shards": len(plans[0]),
        "shards_restored": restored, "bytes": total_numel * 4 * (1 + states),
    }  # fmt: skip


class OldShards:
    """The snapshot's shards in offset order, each pulled once when first needed and dropped
    once the new plan has passed it."""

    def __init__(self, model, name, plan: list[ShardSlice], addresses, states, timeout) -> None:
        plan = sorted(plan, key=lambda s: s.offset)
        self.model, self.name, self.plan = model, name, plan
        self.addresses, self.tensors, self.timeout = addresses, (ps_pb2.MASTER, *states), timeout
        self.offsets = [s.offset for s in plan]
        self.held: dict[int, tuple[ShardSlice, list[torch.Tensor]]] = {}  # shard id -> its tensors

    def _tensors(self, s: ShardSlice) -> list[torch.Tensor]:
        if s.shard_id not in self.held:
            pulled = []
            for tensor in self.tensors:
                request = ps_pb2.PullRequest(model=self.model, shard_id=s.shard_id, tensor=tensor, snapshot=self.name)
                data, _ = client.pull(self.addresses[s.daemon_index], request, s.numel, self.timeout)
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
