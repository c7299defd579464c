"""`ps-admin cluster-file`: the ordered daemon list of a job, written as the cluster file the
trainers and ps-admin read ($PS_CLUSTER_FILE; ps_proto/cluster.py), from a Slurm node list.

Slurm names a job's nodes in its compressed form ($SLURM_JOB_NODELIST, e.g. "gpu[001-004,007],
login2"); python-hostlist expands it the way Slurm's own `scontrol show hostnames` does, in
its order, which every rank of the job then shares as the plan order. One daemon per node, on
`port` (the daemons' server.listen). Written to a temporary file and renamed, so a rank that
reads it early never sees half a list.
"""

from __future__ import annotations

import os
from pathlib import Path

from ps_offload.admin.client import AdminError

SLURM_NODELIST = "SLURM_JOB_NODELIST"


def daemons_of(nodelist: str, port: int) -> list[str]:
    """ "host:port" of every node of a Slurm node list, in its order."""
    try:
        import hostlist
    except ImportError:
        raise AdminError("expanding a Slurm node list needs python-hostlist: pip install 'ps-offload[slurm]'") from None
    try:
        nodes = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise AdminError(f"cannot read the node list {nodelist!r}: {exc}") from None
    if not nodes:
        raise AdminError(f"the node list {nodelist!r} names no node")
    return [f"{node}:{port}" for node in nodes]


def text(daemons: list[str]) -> str:
    quoted = ", ".join(f'"{d}"' for d in daemons)
    return f"# one ps-daemon per node, in plan order (ps-admin cluster-file)\ndaemons = [{quoted}]\n"


def write(out: Path, daemons: list[str]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(text(daemons))
        os.replace(tmp, out)
    except OSError as exc:
        raise AdminError(f"cannot write {out}: {exc.strerror or exc}") from None
