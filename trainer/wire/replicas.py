"""A replicated model (OffloadConfig.replicas) beyond one shard's push and pull: the checks at
registration (its daemons' optimizer kernels must compute alike; a shard's replicas should not
share a host), and the repair of a lost daemon's replicas between steps. Which holders are
lost is ps_offload.trainer.wire.holders.ReplicaHolders' to say and to change; a repair asks it
and tells it."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import grpc
import torch

from ps_offload.optimizers import state_tensors
from ps_offload.proto import ps_pb2
from ps_offload.proto.cluster import ENV_CLUSTER_FILE, ENV_DAEMONS, read_cluster_file
from ps_offload.proto.frames import split_host_port
from ps_offload.proto.plan import ShardSlice
from ps_offload.proto.push import Push
from ps_offload.trainer.config import ClientConfig
from ps_offload.trainer.wire.daemon_client import DaemonError, check_protocol
from ps_offload.trainer.wire.holders import ReplicaHolders, id_ranges
from ps_offload.trainer.wire.transports import Transports

T = TypeVar("T")


class ReplicatedClient(Protocol):
    """What a repair needs of the trainer's ShardedClient (sharded_client.py, which calls it)."""

    model: str
    spec: ps_pb2.ModelSpec
    plan: list[ShardSlice]
    daemons: list[str]
    config: ClientConfig
    digests: list[str]
    transports: Transports
    holders: ReplicaHolders

    def replace_daemon(self, old: str, new: str) -> None: ...
    def pull(self, shard: ShardSlice, *, min_version: int, out: memoryview, tensor: int = ...) -> int: ...
    def call(self, what: str, daemon_index: int, fn: Callable[[], T], *, give_up_seconds: float) -> T: ...


log = logging.getLogger(__name__)


def check_replicas(daemons: list[str], digests: list[str], plan: list[ShardSlice]) -> None:
    """A replicated model's daemons must step alike (check_kernel_digests), and a warning for
    shards whose replicas share a host (losing it loses them all)."""
    check_kernel_digests(daemons, digests)
    hosts = [split_host_port(a)[0] for a in daemons]
    shared = [s.shard_id for s in plan if len({hosts[i] for i in s.holders}) < len(s.holders)]
    if shared and len(set(hosts)) > 1:
        log.warning(
            "%d shards have replicas on the same host (%s): list the daemons node by node, the same number on each, "
            "so that a shard's replicas land on different nodes",
            len(shared), id_ranges(shared),
        )  # fmt: skip


def check_kernel_digests(daemons: list[str], digests: list[str]) -> None:
    """Refuses daemons whose optimizer kernels round differently (RegisterModelResponse.
    kernel_digest; '' from a daemon too old to say): their replicas would drift apart."""
    if len(set(digests)) > 1 or "" in digests:
        said = ", ".join(f"{a}: {d or 'none (an older daemon)'}" for a, d in zip(daemons, digests, strict=True))
        raise RuntimeError(
            f"the daemons' optimizer kernels do not compute alike ({said}): replicas of a shard would drift apart "
            "bit by bit. Their CPUs' vector instructions or torch builds differ; run a replicated model on daemons "
            "of one kind (the same torch, the same CPU family), or without replicas"
        )


COPY_THREADS = 4  # shards a repair copies at once (each: pulls from a live holder, a STATE push)


def _follow_cluster_file(client: ReplicatedClient) -> None:
    """ "The daemon list updated": where the job's list is the cluster file ($PS_CLUSTER_FILE,
    without $PS_DAEMONS), a lost daemon's entry rewritten there to a replacement's address is
    taken (replace_daemon), so every rank converges on it without a call in the script. Only a
    file that still names every live daemon where the trainer has it counts as this job's."""
    path = os.environ.get(ENV_CLUSTER_FILE)
    if not path or os.environ.get(ENV_DAEMONS):
        return
    try:
        listed = read_cluster_file(path)
    except ValueError as exc:
        log.debug("cluster file not followed: %s", exc)
        return
    if len(listed) != len(client.daemons):
        return
    lost = client.holders.lost
    if any(listed[i] != address for i, address in enumerate(client.daemons) if i not in lost):
        return
    for index in sorted(lost):
        if listed[index] != client.daemons[index]:
            client.replace_daemon(client.daemons[index], listed[index])


def repair_lost(client: ReplicatedClient, version: int) -> list[str]:
    """Between steps, with no push in flight and every shard at `version`: each lost daemon
    that answers again holding none of the model's state (a replacement, or the same node
    with its disk wiped) gets every shard it holds copied from a live holder, master and
    optimizer state at `version` (a STATE push), and is a holder again from the next push on.
    Whether it answers is asked off this thread (trainer/wire/lost_probe.py): a daemon gone
    for good costs the step nothing. A replacement just named (replace_daemon, the cluster
    file) or a daemon the run's registration found empty is asked here, once. One that comes
    back with state of its own (restarted from its disk: some steps behind) stays out, said
    once: its copy is stale, and a STATE may only land on a shard with no updates. Returns
    the daemons repaired."""
    repaired = []
    _follow_cluster_file(client)
    holders = client.holders
    for index in sorted(holders.lost):
        response = holders.probe.take(index)
        if response is None:
            continue  # still gone
        address = client.daemons[index]
        if not response.created and index not in holders.fresh_holders:
            if holders.stays_stale(index):
                log.warning(
                    "daemon %s answers again with its own copy of model %r, some steps behind: it stays left "
                    "out. Delete that copy (ps-admin drop %s --partial --daemon %s) to have it repaired from the "
                    "live replicas",
                    address, client.model, client.model, address,
                )  # fmt: skip
            continue
        check_protocol(address, response)
        live = next(i for i in range(len(client.daemons)) if i not in holders.lost)
        check_kernel_digests([client.daemons[live], address], [client.digests[live], response.kernel_digest])
        client.transports.use_data_plane(index, response, client.plan)
        try:
            copied = _copy_shards(client, index, version)
        except DaemonError as error:  # the replacement failed meanwhile: it stays out, training goes on
            log.warning("repairing daemon %s failed (%s): it stays left out", address, error)
            continue
        client.digests[index] = response.kernel_digest
        if holders.repaired(index):  # a replacement: the others' spec learns its address (ps-admin reads it)
            for other in range(len(client.daemons)):
                if other not in holders.lost and other != index:
                    with contextlib.suppress(grpc.RpcError):
                        client.transports.clients[other].register(client.spec, other, timeout=5.0)
        repaired.append(address)
        log.warning(
            "daemon %s repaired: %d shards of model %r copied from their live replicas at step %d; they have all "
            "their holders again", address, copied, client.model, version,
        )  # fmt: skip
    return repaired


def _copy_shards(client: ReplicatedClient, index: int, version: int) -> int:
    """Every shard daemon `index` holds, master and optimizer state at `version`, pulled from
    a live holder and pushed to it as a STATE, COPY_THREADS shards at a time; returns how
    many. A failure of the daemon being repaired (it is given up on after dead_peer_seconds)
    raises DaemonError."""
    held = [s for s in client.plan if index in s.holders]
    tensors = [ps_pb2.MASTER, *(tensor for _, tensor in state_tensors(client.spec))]

    def copy(shard: ShardSlice) -> None:
        state = torch.empty(len(tensors) * shard.numel, dtype=torch.float32)
        view = memoryview(state.numpy()).cast("B")
        nbytes = shard.numel * 4
        for n, tensor in enumerate(tensors):
            got = client.pull(shard, min_version=version, out=view[n * nbytes : (n + 1) * nbytes], tensor=tensor)
            if got != version:
                raise RuntimeError(
                    f"repairing daemon {client.daemons[index]}: shard {shard.shard_id} is at version {got} on its "
                    f"live replica, not {version}: a push is in flight (repair_lost runs between steps only)"
                )
        push = Push.state(client.model, shard.shard_id, view, step=version)
        # Over gRPC: a STATE is (1 + states) times a shard's bytes, more than a local slot holds.
        grpc_client, seconds = client.transports.clients[index], client.config.rpc_timeout_seconds
        client.call(
            push.describe(),
            index,
            lambda p=push, c=grpc_client, t=seconds: c.push(p, timeout=t),
            give_up_seconds=client.config.dead_peer_seconds,
        )

    with ThreadPoolExecutor(max_workers=max(1, min(COPY_THREADS, len(held))), thread_name_prefix="ps-repair") as pool:
        futures = [pool.submit(copy, shard) for shard in held]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
    return len(held)
