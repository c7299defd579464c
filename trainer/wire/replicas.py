"""A replicated model's checks at registration (OffloadConfig.replicas): its daemons'
optimizer kernels must compute alike, and a shard's replicas should not share a host."""

from __future__ import annotations

import logging

from ps_offload.proto.frames import split_host_port
from ps_offload.proto.plan import ShardSlice

log = logging.getLogger(__name__)


def check_replicas(daemons: list[str], digests: list[str], plan: list[ShardSlice]) -> None:
    """A replicated model's daemons must step alike: refuses daemons whose optimizer kernels
    round differently (RegisterModelResponse.kernel_digest; '' from a daemon too old to say),
    and warns of shards whose replicas share a host (losing it loses them all)."""
    if len(set(digests)) > 1 or "" in digests:
        said = ", ".join(f"{a}: {d or 'none (an older daemon)'}" for a, d in zip(daemons, digests, strict=True))
        raise RuntimeError(
            f"the daemons' optimizer kernels do not compute alike ({said}): replicas of a shard would drift apart "
            "bit by bit. Their CPUs' vector instructions or torch builds differ; run a replicated model on daemons "
            "of one kind (the same torch, the same CPU family), or without replicas"
        )
    hosts = [split_host_port(a)[0] for a in daemons]
    shared = [s.shard_id for s in plan if len({hosts[i] for i in s.holders}) < len(s.holders)]
    if shared and len(set(hosts)) > 1:
        log.warning(
            "%d shards have replicas on the same host (%s): list the daemons node by node, the same number on each, "
            "so that a shard's replicas land on different nodes",
            len(shared), id_ranges(shared),
        )  # fmt: skip


def id_ranges(ids: list[int]) -> str:
    """'0-3, 7, 9-10' for [0, 1, 2, 3, 7, 9, 10]."""
    parts, start = [], None
    for i, n in enumerate(ids):
        if start is None:
            start = n
        if i + 1 == len(ids) or ids[i + 1] != n + 1:
            parts.append(f"{start}-{n}" if n != start else f"{n}")
            start = None
    return ", ".join(parts)
