"""The data path every front shares: one push received and applied (receive_push), one pull
served (serve_pull). The gRPC servicer (ps_offload.daemon.rpc.servicer), the TCP data plane
(ps_offload.daemon.dataplane.requests) and the local transport (ps_offload.daemon.dataplane.
local_server) differ only in how the bytes move, so they check, apply and answer identically.

A push: its header is checked (and the push against its shard) before any payload is read; a
push applied before is answered at once, its payload never read. Else the payload lands in a
staging buffer (it must be complete before anything changes, so a broken stream changes
nothing), is parsed there in place (ps_offload.daemon.model.encodings.parse) and applied.

A pull: its shard is held while its bytes are sent, so they are one version (an fp32 pull sends
the shard's own bytes, a narrow one a copy rounded under the hold); a snapshot's pull sends the
snapshot's copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ps_offload.daemon.model.encodings import check_finite, parse
from ps_offload.daemon.rpc import conversions
from ps_offload.daemon.rpc.staging import StagingPool
from ps_offload.daemon.store.master_pull import Scratch
from ps_offload.daemon.store.pull import CheckedPull, PullRequest
from ps_offload.daemon.store.pull_rounding import tensor_bytes
from ps_offload.daemon.store.pull_wait import PullWait
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.proto import ps_pb2

STEPPED = frozenset({"gradient", "gradient_part", "momentum"})
ReadPayload = Callable[[memoryview], None]
"""Fills the view given (the header's nbytes; empty for an APPLY) with the push's payload, or raises."""
InPlace = Callable[[int], torch.Tensor | None]
"""The payload of the nbytes given where it lies, as fp32 elements covering them, or None."""
PullInto = Callable[[int], torch.Tensor]
"""Where the new version goes as well, given the shard's numel; checked there (raises), before
the payload is read."""


def receive_push(
    store: ShardStore,
    header: ps_pb2.PushHeader,
    staging: StagingPool,
    read_payload: ReadPayload,
    *,
    in_place: InPlace | None = None,
    pull_into: PullInto | None = None,
) -> ps_pb2.PushResponse:
    """The answer to a push whose payload `read_payload` reads, once it is applied. A push
    applied before is acknowledged (counted as a duplicate) without reading the payload.
    `in_place(nbytes)`: the payload where it already lies whole (the local transport's shared
    memory), parsed and applied there with no copy; None from it: read into a staging buffer.
    A compressed gradient that must be decompressed first gets a buffer from `staging` too.
    `pull_into(numel)`: where the new version goes as well (ShardStore.push; the local
    transport's), asked for once the push is checked against its shard and before its payload
    is read."""
    checked = store.check_push(conversions.push_request(header))
    if checked.duplicate is not None:  # applied before: answered without reading the payload
        return ps_pb2.PushResponse(applied=False, version=checked.duplicate.version)
    push, shard = checked.push, checked.shard
    target = pull_into(shard.slice.numel) if pull_into is not None else None
    with contextlib.ExitStack() as held:
        payload = in_place(push.nbytes) if in_place is not None else None
        if payload is None:
            payload = held.enter_context(staging.borrow((push.nbytes + 3) // 4))  # fp32 elements, rounded up
            read_payload(memoryview(payload.numpy()).cast("B")[: push.nbytes])
        if push.kind != "apply":  # an APPLY carries none: the parts held are its gradient
            checked = checked.with_data(
                parse(push.encoding, payload, push.nbytes, push.payload_numel(shard), push.where)
            )
            # What the optimizer step would take in (a gradient, a part of one, 1-bit Adam's
            # momentum), before anything changes. Initial values and restored state are copied,
            # once: a check there would be a second pass over a copy for nothing to guard.
            if push.kind in STEPPED and not store.allow_nonfinite_pushes:
                check_finite(checked.push.data, push.where)
        result = store.push(checked, scratch=staging.borrow, pull_into=target)
    return ps_pb2.PushResponse(applied=result.applied, version=result.version, pulled=result.pulled)


@contextlib.contextmanager
def serve_pull(
    store: ShardStore,
    pull: PullRequest | CheckedPull,
    *,
    timeout: float,
    scratch: Scratch,
    waiting: PullWait | None = None,
    waited: float | None = None,
) -> Iterator[tuple[ps_pb2.ShardHeader, memoryview]]:
    """Holds a pull for the block: yields its ShardHeader and the bytes to send after it.
    fp32: the shard's own bytes, under its read hold for the whole send; bf16 or fp16: a copy
    rounded under that hold into a buffer from `staging`. Either way, one version. With
    `pull.snapshot`: the snapshot's copy, read from its slot. `timeout`, `waiting`, `waited`:
    as ShardStore.pull's."""
    request = pull.pull if isinstance(pull, CheckedPull) else pull
    if request.snapshot:
        values, step = store.pull_snapshot(pull)
        yield conversions.shard_header(request.model, request.shard_id, step, values), tensor_bytes(values)
        return
    with store.pull(pull, timeout=timeout, scratch=scratch, waiting=waiting, waited=waited) as (values, version):
        yield conversions.shard_header(request.model, request.shard_id, version, values), tensor_bytes(values)
