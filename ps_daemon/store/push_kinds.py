"""What ShardStore.push runs for each kind of push, once the push is checked against its shard
(ps_offload.daemon.store.push): one function per kind, each called as (store, shard, push, borrow).

* check_apply: an APPLY's check (check_only): its parts are all held; nothing changes.
* add_gradient_part: a GRADIENT_PART added to its step's sum (ps_offload.daemon.store.accumulate);
  neither the shard's values nor its version change. A part 0 sent with `speculate` is then
  stepped ahead into a spare arena (ps_offload.daemon.store.speculation), which its APPLY adopts
  when it names the same settings.
* write_parameters: initial values (PARAMETERS), before the first update.
* restore_state: master and optimizer state (STATE), into a shard that has had no update.
* step_optimizer: one optimizer step from a GRADIENT, a MOMENTUM (1-bit Adam) or the sum of the
  parts (APPLY); the shard's version advances.

The last three write under one hold, taken in one order (_write_held): the shard pinned in RAM
(RamTier.use), its write hold, its parts' lock. The step is checked again there (a retry may
have raced the first attempt), then written, committed and counted. The payload is decompressed
(PushRequest.values) before the hold: the payload and the buffer are this push's own, and
readers need not wait for that.

These are the store's own steps moved out of ShardStore.push (they reach its lock, counters and
files as its methods did); `borrow()` gives an fp32 buffer of the shard's numel that lasts until
the push returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from ps_offload.daemon.model.encodings import OneBitGradient
from ps_offload.daemon.store.accumulate import add_part
from ps_offload.daemon.store.persistence import commit, roll_back
from ps_offload.daemon.store.prefetch import Prefetcher
from ps_offload.daemon.store.push import PushRequest, PushResult, check_step_locked
from ps_offload.daemon.store.registry import ModelRegistry
from ps_offload.daemon.store.shard import Shard
from ps_offload.daemon.store.speculation import SpareArenas, adopt, speculate
from ps_offload.daemon.store.stats import StoreStats
from ps_offload.daemon.tiers.tier import ShardFiles

Borrow = Callable[[], torch.Tensor]


class Store(Protocol):
    """What a push reaches of its store (ps_offload.daemon.store.shard_store.ShardStore)."""

    files: ShardFiles  # where a write is committed
    stats: StoreStats  # counted under _lock
    spares: SpareArenas  # what speculative steps write into
    prefetcher: Prefetcher
    on_optimizer_step: Callable[[float], None] | None
    _lock: threading.Lock
    registry: ModelRegistry

    def _using(self, shard: Shard) -> contextlib.AbstractContextManager[object]: ...


def check_apply(store: Store, shard: Shard, push: PushRequest, borrow: Borrow) -> PushResult:
    """An APPLY's check: the parts are all held (else it raises); applies nothing."""
    with shard.cond:
        ack = check_step_locked(shard, push)
    with shard.parts.lock:
        if ack is None:
            shard.parts.check_count_locked(push)
    return ack or PushResult(applied=False, version=shard.version)


def add_gradient_part(store: Store, shard: Shard, push: PushRequest, borrow: Borrow) -> PushResult:
    """A GRADIENT_PART: no update, nor the shard's values: its sum only."""
    result = add_part(shard, push, borrow)
    with store._lock:
        if result.applied:
            store.stats.bytes_pushed += push.payload_bytes
        else:
            store.stats.pushes_duplicate += 1
    if result.applied and push.speculate and store.spares.budget >= shard.arena_bytes:
        with store._using(shard), shard.writing_lock(), shard.parts.lock:
            if shard.parts.speculation is None:
                shard.parts.speculation = speculate(shard, push, store.spares)
    return result


def write_parameters(store: Store, shard: Shard, push: PushRequest, borrow: Borrow) -> PushResult:
    """PARAMETERS: the master values, and the shard initialized."""
    data = push.values(borrow)

    def write() -> None:
        shard.parts.discard_speculation_locked()
        shard.master.copy_(data)
        shard.initialized = True
        commit(store.files, shard)

    return _write_held(store, shard, push, write)


def restore_state(store: Store, shard: Shard, push: PushRequest, borrow: Borrow) -> PushResult:
    """A STATE: master and optimizer state from the payload (checked by the push), the shard at
    version push.step."""
    data = push.values(borrow)
    push.check_state(shard)

    def write() -> None:
        shard.parts.discard_speculation_locked()
        numel = shard.slice.numel
        for index, tensor in enumerate([shard.master, *shard.optimizer.state]):
            tensor.copy_(data[index * numel : (index + 1) * numel])
        shard.set_version(push.step, initialized=True)
        commit(store.files, shard)

    return _write_held(store, shard, push, write)


def step_optimizer(
    store: Store, shard: Shard, push: PushRequest, borrow: Borrow, pull_into: torch.Tensor | None = None
) -> PushResult:
    """GRADIENT, MOMENTUM or APPLY: one optimizer step, then the parts of the step are spent.
    `pull_into` (a GRADIENT or APPLY's): a tensor as long as the shard, in a pull's dtype, that
    gets the new master values in the step's own pass, as a pull would write them; on a failed
    update, the values the shard is back at."""
    data = None
    if push.kind == "gradient":
        data = push.gradient(borrow)
    elif push.kind == "momentum":
        data = push.values(borrow)
    # (.get: the model may have been dropped since; its shards then end NOT_FOUND below)
    store.prefetcher.pushed(shard, push.step, lambda: store.registry.shards_of(shard.model))

    def write() -> None:
        gradient = shard.parts.gradient_locked(push) if push.kind == "apply" else data
        ahead = shard.parts.claim_speculation_locked(push) if push.kind == "apply" else None
        try:
            if ahead is not None:  # computed during backward, with what this APPLY names
                elapsed = adopt(shard, ahead, pull_into)
            else:
                elapsed = _optimizer_step(store, shard, push, gradient, pull_into)
            commit(store.files, shard)
        except BaseException:
            if pull_into is not None and not shard.corrupt:  # the trainer must not keep values never committed
                pull_into.copy_(shard.master)
            raise
        shard.parts.drop_applied_locked(shard.version)  # committed: the parts are spent
        with store._lock:
            store.stats.optimizer_seconds += elapsed
            store.stats.pushes_applied += 1
            if pull_into is not None:
                store.stats.pulls += 1
                store.stats.pulls_carried += 1
                store.stats.bytes_pulled += pull_into.numel() * pull_into.element_size()
        if store.on_optimizer_step is not None:
            store.on_optimizer_step(elapsed)

    result = _write_held(store, shard, push, write)
    return dataclasses.replace(result, pulled=pull_into is not None and result.applied)


BY_KIND: dict[str, Callable[[Store, Shard, PushRequest, Borrow], PushResult]] = {
    "gradient": step_optimizer,
    "momentum": step_optimizer,
    "apply": step_optimizer,
    "gradient_part": add_gradient_part,
    "parameters": write_parameters,
    "state": restore_state,
}


def _write_held(store: Store, shard: Shard, push: PushRequest, write: Callable[[], None]) -> PushResult:
    """`write()` (which commits) under the shard's hold, unless the push turns out applied before."""
    with store._using(shard), shard.writing_lock(), shard.parts.lock:
        # Re-checked under the lock: a retry may have raced the first attempt.
        ack = check_step_locked(shard, push)
        if ack is not None:
            with store._lock:
                store.stats.pushes_duplicate += 1
            return ack
        write()
        with store._lock:
            store.stats.bytes_pushed += push.payload_bytes
        return PushResult(applied=True, version=shard.version)


def _optimizer_step(
    store: Store,
    shard: Shard,
    push: PushRequest,
    data: torch.Tensor | OneBitGradient | tuple,
    pull_into: torch.Tensor | None = None,
) -> float:
    """One optimizer step on a shard held for writing (its version advances); returns the
    seconds it took. `data`: a MOMENTUM's values, or a gradient and its multiplier."""
    started = time.perf_counter()
    lr = shard.optimizer.config.lr if push.lr is None else push.lr
    try:
        if push.kind == "momentum":
            shard.optimizer.apply_momentum(shard.master, data, lr, push.variance_frozen_at)
        else:
            gradient, multiplier = data
            shard.optimizer.apply(shard.master, gradient, lr, push.groups, multiplier=multiplier, out=pull_into)
    except BaseException:
        roll_back(store.files, shard)  # validation should leave nothing to fail here; a kernel did
        raise
    shard.version += 1
    return time.perf_counter() - started
