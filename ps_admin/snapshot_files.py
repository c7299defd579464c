"""`ps-admin snapshot export` and `restore --from`: a snapshot off its daemons' disks, into a
directory (shared storage, another host), and back onto any number of daemons.

A snapshot pins slots on each daemon's own disk, so losing a node loses its part. An export
copies the consistent cut out, per parameter, in files a torch user can read:

    DIR/manifest.json                              what and where (written last)
    DIR/master-00001-of-00003.safetensors          {param name: tensor of its shape}
    DIR/exp_avg-00001-of-00003.safetensors         AdamW's first moment, likewise
    DIR/exp_avg_sq-00001-of-00003.safetensors      AdamW's second moment
    (SGD with momentum: momentum_buffer-*; SGD without: master only)

`safetensors.torch.load_file(DIR / "master-00001-of-00003.safetensors")` gives those
parameters at the snapshot's step. The parameters are cut into parts of about `part_bytes`
of fp32 each (a larger parameter is a part of its own), the same parts for every tensor.
manifest.json (FORMAT) holds the model's spec (as ps.proto's JSON), the step, each
parameter's shape and place in the flat layout, and each file's size and crc32c.

Resumable: a file is written under a temporary name and renamed, and a part whose files are
there (the same model, snapshot and step in their metadata) is kept by a run that follows an
interrupted one. The manifest comes last, so a directory without one is not an export (yet).
A restore checks every file's crc32c before anything is registered, then registers the model
afresh on the targets and pushes its shards as STATE (snapshot_restore.restore_into): bit for bit
what the daemons held.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import crc32c
import torch
from google.protobuf import json_format
from rich.progress import Progress

from ps_offload.admin import snapshot_restore, snapshots
from ps_offload.admin.client import AdminError, owners
from ps_offload.optimizers import state_tensors
from ps_offload.proto import ps_pb2

FORMAT = "ps-offload-snapshot/1"
MANIFEST = "manifest.json"
PART_BYTES = 1 << 30


def _parts(params, part_bytes: int) -> list[list[int]]:
    """Parameter indices in offset order, cut into runs of about `part_bytes` of fp32."""
    parts: list[list[int]] = [[]]
    held = 0
    for index in sorted(range(len(params)), key=lambda i: params[i].offset):
        if parts[-1] and held + 4 * params[index].numel > part_bytes:
            parts.append([])
            held = 0
        parts[-1].append(index)
        held += 4 * params[index].numel
    return parts


def _crc(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            value = crc32c.crc32c(chunk, value)
    return value


def _kept(path: Path, metadata: dict[str, str]) -> bool:
    """Whether an earlier run wrote this file for the same snapshot (renamed into place: whole)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() == metadata
    except (OSError, SafetensorError):
        return False


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def export(
    model: str, name: str, daemons: list[str], out: Path, *, part_bytes: int, timeout: float, progress: Progress
) -> dict[str, Any]:
    """Writes snapshot `name` of `model` (taken on its daemons) into `out`; returns a summary."""
    info, addresses = owners(model, daemons, timeout)
    step, sources = snapshots.snapshot_sources(model, name, info, addresses, timeout)
    states = state_tensors(info.spec)
    kinds = ["master", *(kind for kind, _ in states)]
    manifest_path = out / MANIFEST
    if manifest_path.exists():
        done = _manifest(out)
        if (done["model"], done["snapshot"], done["step"]) != (model, name, step):
            raise AdminError(
                f"{out} holds another export (snapshot {done['snapshot']!r} of {done['model']!r} at step "
                f"{done['step']}); export into an empty directory"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AdminError(f"cannot write {out}: {exc.strerror or exc}") from None
    parts = _parts(info.params, part_bytes)
    metadata = {"format": FORMAT, "model": model, "snapshot": name, "step": str(step)}
    plan = snapshots.plan_of(info.shards)
    source = snapshot_restore.OldShards(model, name, plan, sources, [t for _, t in states], timeout)
    task = progress.add_task(f"export {model}/{name}", total=info.total_numel * 4 * len(kinds))
    files, written = {}, 0
    for number, indices in enumerate(parts, 1):
        names = {kind: f"{kind}-{number:05d}-of-{len(parts):05d}.safetensors" for kind in kinds}
        part_numel = sum(info.params[i].numel for i in indices)
        if not all(_kept(out / file, metadata) for file in names.values()):
            tensors: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in kinds}
            for i in indices:
                param = info.params[i]
                for tensor_index, kind in enumerate(kinds):
                    values = torch.empty(param.numel, dtype=torch.float32)
                    source.copy_range(param.offset, param.numel, tensor_index, values)
                    tensors[kind][param.name] = values.view(tuple(param.shape))
            try:
                for kind in kinds:
                    _write(out / names[kind], tensors[kind], metadata)
            except OSError as exc:
                raise AdminError(f"cannot write {out}: {exc.strerror or exc}") from None
            written += 1
        for kind, file in names.items():
            files[file] = {"tensor": kind, "part": number, "bytes": (out / file).stat().st_size,
                           "crc32c": _crc(out / file)}  # fmt: skip
        progress.advance(task, part_numel * 4 * len(kinds))
    part_of = {index: number for number, indices in enumerate(parts, 1) for index in indices}
    manifest = {
        "format": FORMAT,
        "model": model,
        "snapshot": name,
        "step": step,
        "spec": json_format.MessageToDict(info.spec, preserving_proto_field_name=True),
        "total_numel": info.total_numel,
        "tensors": kinds,
        "params": [
            {
                "name": p.name,
                "shape": list(p.shape),
                "offset": p.offset,
                "numel": p.numel,
                "part": part_of[i],
            }
            for i, p in enumerate(info.params)
        ],  # fmt: skip
        "files": files,
    }
    tmp = manifest_path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(manifest_path)
    total = sum(f["bytes"] for f in files.values())
    return {"model": model, "snapshot": name, "step": step, "out": str(out), "parts": len(parts),
            "parts_written": written, "files": len(files), "bytes": total}  # fmt: skip


def _manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdminError(
            f"{directory} has no {MANIFEST}: not a snapshot export, or one interrupted before its end (run the "
            "export again: it keeps what it wrote)"
        ) from None
    except (OSError, ValueError) as exc:
        raise AdminError(f"cannot read {path}: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise AdminError(f"{path} is format {manifest.get('format')!r}; this ps-admin reads {FORMAT!r}")
    return manifest


class _FileParams:
    """An export's parameters as the flat layout's tensors: copy_range reads the parameters
    that overlap a range, a few held at a time (the restore goes forward in offset order)."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory = directory
        self.params = sorted(manifest["params"], key=lambda p: p["offset"])
        self.kinds = manifest["tensors"]
        self.parts = max(p["part"] for p in self.params)
        self.held: dict[tuple[str, str], tuple[int, torch.Tensor]] = {}  # (kind, name) -> (end, values)

    def _values(self, kind: str, param: dict[str, Any]) -> torch.Tensor:
        key = (kind, param["name"])
        if key not in self.held:
            from safetensors import safe_open

            file = self.directory / f"{kind}-{param['part']:05d}-of-{self.parts:05d}.safetensors"
            with safe_open(str(file), "pt") as f:
                values = f.get_tensor(param["name"]).reshape(-1)
            if values.numel() != param["numel"] or values.dtype != torch.float32:
                raise AdminError(f"{file}: {param['name']} is not {param['numel']} float32 values")
            self.held[key] = (param["offset"] + param["numel"], values)
        return self.held[key][1]

    def copy_range(self, start: int, numel: int, tensor_index: int, out: torch.Tensor) -> None:
        end, kind = start + numel, self.kinds[tensor_index]
        for key in [k for k, (stop, _) in self.held.items() if stop <= start]:
            del self.held[key]  # the restore goes forward: never needed again
        covered = 0
        for param in self.params:
            lo, hi = max(start, param["offset"]), min(end, param["offset"] + param["numel"])
            if lo < hi:
                out[lo - start : hi - start] = self._values(kind, param)[lo - param["offset"] : hi - param["offset"]]
                covered += hi - lo
        if covered != numel:
            raise AdminError(f"the export's parameters do not cover elements {start} to {end} of the flat layout")


def restore_from(
    directory: Path,
    model: str,
    name: str,
    targets: list[str],
    *,
    new_name: str | None,
    shard_bytes: int | None,
    timeout: float,
    progress: Progress,
) -> dict[str, Any]:
    """Checks the export in `directory` (every file's crc32c), then restores it onto `targets`."""
    manifest = _manifest(directory)
    if (manifest["model"], manifest["snapshot"]) != (model, name):
        raise AdminError(
            f"{directory} holds snapshot {manifest['snapshot']!r} of model {manifest['model']!r}, not {name!r} of "
            f"{model!r}"
        )
    task = progress.add_task(f"check {directory.name}", total=sum(f["bytes"] for f in manifest["files"].values()))
    for file, entry in sorted(manifest["files"].items()):
        path = directory / file
        try:
            size, crc = path.stat().st_size, _crc(path)
        except OSError as exc:
            raise AdminError(f"cannot read {path}: {exc.strerror or exc}") from None
        if (size, crc) != (entry["bytes"], entry["crc32c"]):
            raise AdminError(
                f"{path} is not the file the export wrote ({size} bytes, crc32c {crc:#010x}; the manifest says "
                f"{entry['bytes']} bytes, {entry['crc32c']:#010x}): nothing was restored"
            )
        progress.advance(task, size)
    spec = json_format.ParseDict(manifest["spec"], ps_pb2.ModelSpec())
    states = len(state_tensors(spec))
    if manifest["tensors"] != ["master", *(kind for kind, _ in state_tensors(spec))]:
        raise AdminError(f"{directory}: its tensors {manifest['tensors']} do not match its optimizer")
    target = snapshot_restore.Target(spec, targets, new_name=new_name, shard_bytes=shard_bytes)
    source = _FileParams(directory, manifest)
    row = snapshot_restore.restore_into(
        target, manifest["step"], source, manifest["total_numel"], states, timeout=timeout, progress=progress
    )
    return {"from": model, "snapshot": name, "directory": str(directory), **row}
