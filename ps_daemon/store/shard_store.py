"""The data path of one daemon: pull, push with (shard, step) dedup, commit; prefetch hints
and the counters. Which models there are is the registry's (ps_offload.daemon.store.registry:
register, recover, look up, drop); each request's shard is looked up there once, checked once
(`check_push` -> CheckedPush, `check_pull` -> CheckedPull) and handed on with the request. The
pieces it composes: ps_offload.daemon.store.shard (one shard and its hold),
ps_offload.daemon.store.push (one push, validated), ps_offload.daemon.store.push_kinds (what each
kind of push runs), ps_offload.daemon.store.prefetch (what to load ahead),
ps_offload.daemon.store.stats (its counters), ps_offload.daemon.store.persistence (a shard's
committed copy), ps_offload.daemon.store.master_pull (master pulls from disk), and the tiers it
is given, as the roles of ps_offload.daemon.tiers.tier (the composition root,
ps_offload.daemon.composition, chooses them: the store imports no tier of its own).

No gRPC here: the servicer translates protobuf to these calls, and ps_offload.daemon.rpc.status the
typed errors of ps_offload.daemon.errors back to status codes.

Versions: a shard's version is the number of gradient updates applied to it. A gradient
push for `step` is applied only when step == version, then version becomes step + 1; a push
for step < version was applied before and is acknowledged without effect (so retries are
safe); a push for step > version is from the future and refused. Initial values are pushed
once, before the first update, and mark the shard `initialized`; pulls wait for that. A
gradient pushed in parts is held beside the shard until its APPLY (ps_offload.daemon.store.accumulate).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch

from ps_offload.daemon.store import push_kinds, snapshot_admin
from ps_offload.daemon.store.limits import StoreLimits
from ps_offload.daemon.store.master_pull import Scratch, pull_master
from ps_offload.daemon.store.prefetch import Prefetcher
from ps_offload.daemon.store.pull import CheckedPull, PullRequest
from ps_offload.daemon.store.pull_rounding import check_pull_dtype, element_bytes, rounded
from ps_offload.daemon.store.pull_wait import PullWait
from ps_offload.daemon.store.push import CheckedPush, PushRequest, PushResult, check_step_locked
from ps_offload.daemon.store.registry import ModelRegistry
from ps_offload.daemon.store.replica_reports import ReplicaHealth, ReplicaReports
from ps_offload.daemon.store.residency_window import ResidencyWindow
from ps_offload.daemon.store.shard import Shard, allocate_arena
from ps_offload.daemon.store.speculation import SpareArenas
from ps_offload.daemon.store.stats import StatsSnapshot, StoreStats, tier_counts
from ps_offload.daemon.tiers.tier import ResidencyTier, ShardFiles, SumStore, Tiers


class ShardStore:
    def __init__(
        self,
        tiers: Tiers,
        *,
        ram_bytes: int,
        default_shard_bytes: int,
        prefetch_depth: int = 2,
        limits: StoreLimits | None = None,
        allow_nonfinite_pushes: bool = False,
        speculation_bytes: int = 0,
    ) -> None:
        """`tiers`: built by ps_offload.daemon.composition. `speculation_bytes`: spare arenas for
        steps computed while backward runs (ps_offload.daemon.store.speculation); 0: none, every
        part waits for its APPLY."""
        self.ram_bytes = ram_bytes
        # Read by the fronts before a push is applied (ps_offload.daemon.rpc.data_path).
        self.allow_nonfinite_pushes = allow_nonfinite_pushes
        # Past this point the store asks `self.files.at_rest` only where the two kinds of daemon
        # behave differently.
        self.files: ShardFiles = tiers.files
        self.tier: ResidencyTier = tiers.residency
        self.accumulators: SumStore = tiers.sums  # sums of steps pushed in parts (ps_offload.daemon.store.accumulate)
        self.registry = ModelRegistry(
            tiers, ram_bytes=ram_bytes, default_shard_bytes=default_shard_bytes, limits=limits or StoreLimits()
        )
        self.registry.on_drop.append(self._forget)
        self.prefetcher = Prefetcher(self.tier, depth=prefetch_depth if self.files.at_rest else 0)
        self.window = ResidencyWindow(
            self.prefetcher, budget=ram_bytes, shards_of=self.registry.shards_of,
            models=lambda: len(self.registry.models()),
        )  # fmt: skip
        self.spares = SpareArenas(speculation_bytes, allocate_arena)
        self.stats = StoreStats()
        self.replica_reports = ReplicaReports()  # trainers' word on lost holders (metrics)
        # Called with each shard's optimizer time, outside the store's locks (metrics).
        self.on_optimizer_step: Callable[[float], None] | None = None
        self._lock = threading.Lock()  # guards the stats counters

    def _forget(self, name: str) -> None:
        """What the store itself keeps of a model the registry dropped."""
        self.spares.trim()
        self.replica_reports.forget(name)

    # -- data path ----------------------------------------------------------------------

    def check_pull(self, pull: PullRequest) -> CheckedPull:
        """The pull with its shard, looked up and checked once (a snapshot's copy is checked
        when it is read)."""
        shard = self.registry.shard(pull.model, pull.shard_id)
        shard.check_tensor(pull.tensor)
        if not pull.snapshot:
            check_pull_dtype(pull.dtype, pull.tensor, pull.where, shard.state_dtype)
        return CheckedPull(pull, shard)

    @contextlib.contextmanager
    def pull(
        self,
        pull: PullRequest | CheckedPull,
        *,
        timeout: float,
        scratch: Scratch | None = None,
        waiting: PullWait | None = None,
        waited: float | None = None,
    ) -> Iterator[tuple[torch.Tensor, int]]:
        """Holds the shard for reading at pull.min_version or later: yields (its `pull.tensor`,
        version), the tensor one of SHARD_TENSORS. The caller streams the tensor inside the block.
        A PullRequest is checked first (check_pull); a CheckedPull is not checked again.
        `pull.dtype` bfloat16 or float16 (master only; ps_offload.daemon.store.pull_rounding): yields the master
        values rounded under the hold into a buffer from `scratch(n)` (as push's), and the
        hold ends there. With an NVMe tier, the master values of a shard that is not resident
        are read from disk into a buffer from `scratch`, without loading the shard
        (ps_offload.daemon.store.master_pull), and the hold ends there too. `waiting`: a gRPC pull's bound
        on waiting for the version (ps_offload.daemon.store.pull_wait); `waited`: how long the caller has
        waited already (for the message if the version is still not there). Not for pull.snapshot
        (pull_snapshot)."""
        checked = pull if isinstance(pull, CheckedPull) else self.check_pull(pull)
        request, shard = checked.pull, checked.shard
        shard.await_version(request.min_version, timeout, waiting, waited=waited)  # the wait, holding nothing
        with contextlib.ExitStack() as sending:
            yield self._pulled(sending, shard, request, timeout, scratch)
        with self._lock:
            self.stats.pulls += 1
            self.stats.bytes_pulled += shard.slice.numel * element_bytes(request.dtype)  # the bytes sent

    def _pulled(
        self,
        sending: contextlib.ExitStack,
        shard: Shard,
        pull: PullRequest,
        timeout: float,
        scratch: Scratch | None,
    ) -> tuple[torch.Tensor, int]:
        """pull's (values, version), with what must last while they are sent entered on `sending`."""
        tensor, dtype, min_version = pull.tensor, pull.dtype, pull.min_version
        if tensor == "master" and self.files.at_rest:
            # (A resident shard is served from RAM by pull_master: no window to ask.)
            upcoming = None if shard.resident else self.window.holds(shard)
            if upcoming is not None:
                # Loaded whole below and kept until its update (ps_offload.daemon.store.residency_window):
                # limit=0 queues no load, it only makes the learned order the tier's upcoming use.
                self.tier.prefetch(upcoming, limit=0)
                with self._lock:
                    self.stats.window_loads += 1
            else:
                pulled = pull_master(sending, self.files, self.tier, shard, pull, timeout=timeout, scratch=scratch)
                if pulled is not None:
                    return pulled
        if dtype == shard.state_dtype:
            sending.enter_context(self._using(shard, pull=True))
            # The tensor is taken under the hold: a step computed ahead swaps the shard's arena
            # under the write hold (ps_offload.daemon.store.speculation).
            version = sending.enter_context(shard.reading(min_version, timeout))
            return shard.tensor(tensor), version
        with self._using(shard, pull=True), shard.reading(min_version, timeout) as version:
            # The rounded (or, from bf16 state, widened) copy is this pull's own: the next
            # update need not wait for the send.
            return sending.enter_context(rounded(shard.tensor(tensor), dtype, scratch)), version

    def check_push(self, push: PushRequest) -> CheckedPush:
        """Validates a push before its payload is read (`push.data` None: its announced
        `nbytes`), looking its shard up once: the CheckedPush goes on to `push` with its
        payload. Its `duplicate` is the acknowledgement of a push that was applied before (no
        payload needed; counted as a duplicate), else None."""
        model, shard = self.registry.located(push.model, push.shard_id)
        push.check_shard(shard)
        spec = model.spec
        ReplicaReports.check(
            push.lost_holders, replicas=spec.replicas, daemons=len(spec.daemons), own_index=model.daemon_index,
            where=push.where,
        )  # fmt: skip
        if spec.replicas > 1:  # (an unreplicated model's pushes carry none: checked above)
            self.replica_reports.note(spec.model, push.lost_holders, spec.daemons, model.plan, model.daemon_index)
        with shard.cond:
            ack = check_step_locked(shard, push)
        if ack is None and push.kind in ("gradient_part", "apply"):
            ack = shard.parts.check(push, shard.version)
        if ack is not None:
            with self._lock:
                self.stats.pushes_duplicate += 1
        return CheckedPush(push, shard, ack)

    def push(
        self,
        push: PushRequest | CheckedPush,
        *,
        scratch: Scratch | None = None,
        pull_into: torch.Tensor | None = None,
    ) -> PushResult:
        """Applies a gradient or a momentum (1-bit Adam), or writes initial values, held in
        `push.data`: fp32 with the shard's numel, or compressed (ps_offload.daemon.model.encodings); adds a
        GRADIENT_PART to the step's sum, or applies that sum (APPLY, no data). A PushRequest is
        checked against its shard first; a CheckedPush (check_push) is not checked again.
        Compressed values that the optimizer does not take as they are (all but a ONEBIT
        momentum, TOPK and ONEBIT gradients) are first decompressed into an fp32 buffer from
        `scratch(numel)` (a StagingPool's borrow; a fresh tensor if None). Everything is checked
        before the shard changes. Each kind is one function of ps_offload.daemon.store.push_kinds.
        `pull_into` (GRADIENT and APPLY; checked by the caller: the shard's numel, fp32, bf16 or
        fp16): gets the new version as a pull would write it, in the update's own pass
        (PushResult.pulled); other kinds leave it alone."""
        if isinstance(push, CheckedPush):
            push, shard = push.push, push.shard
        else:
            shard = self.registry.shard(push.model, push.shard_id)
            push.check_shard(shard)
        if push.data is None and push.kind != "apply":
            raise ValueError("push() needs the payload (PushRequest.with_data)")
        numel = shard.slice.numel
        with contextlib.ExitStack() as held:  # the buffers borrowed, given back once the push is done

            def borrow() -> torch.Tensor:
                return held.enter_context(scratch(numel)) if scratch else torch.empty(numel, dtype=torch.float32)

            if push.check_only:
                return push_kinds.check_apply(self, shard, push, borrow)
            if pull_into is not None and push.kind in ("gradient", "apply"):
                return push_kinds.step_optimizer(self, shard, push, borrow, pull_into)
            return push_kinds.BY_KIND[push.kind](self, shard, push, borrow)

    def replica_health(self) -> list[ReplicaHealth]:
        """Each replicated model held, as its trainer last reported its holders (replica_reports)."""
        models = {m.spec.model: (m.plan, m.daemon_index) for m in self.registry.models() if m.spec.replicas > 1}
        return self.replica_reports.health(models)

    def prefetch(self, model: str, shard_ids: list[int]) -> int:
        """A trainer's hint: these shards next, in this order. Queued for loading into the
        RAM tier (bounded by its free room); returns how many were queued."""
        shards = [self.registry.shard(model, shard_id) for shard_id in shard_ids]
        with self._lock:
            self.stats.prefetch_hints += len(shard_ids)
        return self.prefetcher.hint(shards)

    # -- tiers ----------------------------------------------------------------------------

    def updates_at_once(self, model: str, most: int) -> int:
        """How many of `model`'s updates may be in flight at once without taking the RAM tier's
        room from the residency window (ps_offload.daemon.store.residency_window); 1 without NVMe."""
        return self.window.updates_at_once(model, most) if self.files.at_rest else 1

    def _using(self, shard: Shard, *, pull: bool = False) -> contextlib.AbstractContextManager[None]:
        """Pins the shard in RAM for the block (loading it if it was on NVMe; TierFull, a
        ResourceExhausted, when the tier has no room for it in time). `pull`: a read, after
        which the shard's push is still to come (the tier keeps it upcoming)."""
        return self.tier.use(shard, pull=pull)

    def stats_snapshot(self) -> StatsSnapshot:
        models = self.registry.models()
        shards = [shard for model in models for shard in model.shards.values()]
        ram_used = self.registry.resident_bytes()
        with self._lock:
            s = self.stats
            return StatsSnapshot(
                models=len(models),
                shards=len(shards),
                ram_bytes_used=ram_used,
                bytes_pulled=s.bytes_pulled,
                bytes_pushed=s.bytes_pushed,
                pulls=s.pulls,
                pulls_carried=s.pulls_carried,
                pushes_applied=s.pushes_applied,
                pushes_duplicate=s.pushes_duplicate,
                optimizer_seconds=s.optimizer_seconds,
                prefetch_hints=s.prefetch_hints,
                window_loads=s.window_loads,
                uptime_seconds=time.monotonic() - s.started,
                speculative_steps=self.spares.committed,
                speculative_redone=self.spares.discarded,
                speculation_bytes=self.spares.bytes,
                **tier_counts(self.files, self.tier, self.ram_bytes, shards),
            )

    # -- snapshots (taken, listed and deleted by ps_offload.daemon.store.snapshot_admin) -----

    def pull_snapshot(self, pull: PullRequest | CheckedPull) -> tuple[torch.Tensor, int]:
        """(`pull.tensor` of the shard as snapshot `pull.snapshot` holds it, the snapshot's
        step): a copy of this pull's own, read from the snapshot's slot."""
        checked = pull if isinstance(pull, CheckedPull) else self.check_pull(pull)
        request = checked.pull
        values, step = snapshot_admin.read_tensor(self.files, checked.shard, request.snapshot, request.tensor)
        with self._lock:
            self.stats.pulls += 1
            self.stats.bytes_pulled += values.numel() * 4
        return values, step

    def close(self) -> None:
        self.tier.close()
