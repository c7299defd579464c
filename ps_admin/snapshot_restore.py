"""`ps-admin snapshot restore`: a snapshot's master values and optimizer state, pulled from
its daemons (PullRequest.snapshot) or read from an export (snapshot_files.py), pushed as STATE
into a model registered afresh on the target daemons, possibly more or fewer of them and with
another shard size (the plan re-cut).

The flat layout is the same, so each new shard gathers its slices from the old shards (or
parameters) that overlap it, a few held at a time: memory is a few shards, not the model.
Running it again after a failure finishes the job (a shard already restored answers
duplicate). The trainer then registers the same spec and resumes at step S. The state
carried: each optimizer's state tensors (AdamW's exp_avg and exp_avg_sq, SGD's momentum
buffer, none for SGD without momentum) beside the master values.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
from rich.progress import Progress

from ps_offload.admin import client
from ps_offload.admin.client import AdminError, owners
from ps_offload.admin.snapshots import plan_of, snapshot_sources
from ps_offload.optimizers import state_tensors
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice


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
