"""`ps-admin export`: a model's parameters pulled from every daemon that owns a shard of it
(of a replicated model, from a live holder of each), reassembled per parameter with its
shape, and written as one safetensors file.

The plan comes from the daemons (GetModel), not from a trainer: each shard is pulled over
ParameterServer.Pull at the lowest version any shard holds, so an idle model exports at one
step and a model being trained is refused unless mixed versions are allowed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from rich.progress import Progress

from ps_offload.admin import client
from ps_offload.admin.client import AdminError, owners
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ParamLayout, ShardSlice, segments_of

FORMATS = ("safetensors",)


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


def _sources(
    model: str, addresses: list[str], named: list[str], info: ps_pb2.ModelInfo, timeout: float
) -> tuple[dict[int, str], dict[int, int]]:
    """Where each shard is pulled from, and its version there: its primary, or of a replicated
    model the first of its holders that answers holding its values. Every shard must hold
    values somewhere."""
    answers: dict[str, dict[int, ps_pb2.ShardInfo] | AdminError] = {}

    def shards_on(address: str) -> dict[int, ps_pb2.ShardInfo] | AdminError:
        if address not in answers:
            try:
                with _owner(address, named):
                    answers[address] = {s.shard_id: s for s in client.list_shards(address, model, timeout)}
            except AdminError as exc:
                answers[address] = exc
        return answers[address]

    sources, versions = {}, {}
    for shard in info.shards:
        problems = []
        for index in shard.holders or [shard.daemon_index]:
            address = addresses[index]
            held = shards_on(address)
            if isinstance(held, AdminError):
                problems.append(held)
                continue
            if shard.shard_id in held and held[shard.shard_id].initialized:
                sources[shard.shard_id], versions[shard.shard_id] = address, held[shard.shard_id].version
                break
            problems.append(
                AdminError(
                    f"shard {shard.shard_id} of model {model!r} on daemon {address} holds no values yet "
                    "(its trainer never pushed them); nothing to export"
                )
            )
        else:
            raise problems[0]
    return sources, versions


def export_model(
    model: str, daemons: list[str], *, timeout: float, allow_mixed: bool, progress: Progress
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Pulls every shard of `model` from the daemons that own it and reassembles each
    parameter with its shape. Returns the tensors and safetensors metadata."""
    info, addresses = owners(model, daemons, timeout)
    plan = [ShardSlice(s.shard_id, s.daemon_index, s.offset, s.numel) for s in info.shards]
    layouts = [ParamLayout(i, p.name, tuple(p.shape), p.offset, p.numel, None) for i, p in enumerate(info.params)]
    sources, versions = _sources(model, addresses, daemons, info, timeout)
    low, high = min(versions.values(), default=0), max(versions.values(), default=0)
    if low != high and not allow_mixed:
        raise AdminError(
            f"the shards of model {model!r} are at versions {low} to {high}: it is being trained. Export between "
            "steps, when it is idle, or pass --allow-mixed-versions"
        )
    flats = [torch.empty(p.numel, dtype=torch.float32) for p in layouts]
    task = progress.add_task(f"export {model}", total=info.total_numel * 4)

    def fetch(s: ShardSlice) -> int:
        address = sources[s.shard_id]
        with _owner(address, daemons):
            data, version = client.pull_shard(address, model, s, low, timeout)
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


def export_file(
    out: Path, model: str | None, daemons: list[str], *, timeout: float, allow_mixed: bool, progress: Progress
) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """Exports `model` (None: the only one the first daemon holds) to a safetensors file at
    `out`; returns the model's name, its tensors and the file's metadata.

    The file is written beside `out` and renamed over it, so a reader never finds half a
    file; any OSError on the way (an unwritable file, an unreadable certificate) is an
    AdminError "cannot write", and no temporary file stays."""
    from safetensors import SafetensorError  # imported late: only export needs them
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    try:
        name = client.resolve_model(daemons[0], model, timeout)
        tensors, metadata = export_model(name, daemons, timeout=timeout, allow_mixed=allow_mixed, progress=progress)
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(out)
    except (OSError, SafetensorError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise AdminError(f"cannot write {out}: {getattr(exc, 'strerror', None) or exc}") from None
    return name, tensors, metadata
