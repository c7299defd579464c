"""Shards held by one daemon: registration, recovery, pull, push with (shard, step) dedup,
commit. The pieces it composes: ps_offload.daemon.model.spec (what a model is), ps_offload.daemon.store.shard (one
shard and its hold), ps_offload.daemon.store.push (one push, validated), ps_offload.daemon.store.prefetch (what to load
ahead), ps_offload.daemon.store.stats (its counters), ps_offload.daemon.tiers (RAM over NVMe, or RAM only: the roles
in ps_offload.daemon.tiers.tier),
ps_offload.daemon.store.persistence (a shard's committed copy: load, commit, roll back a failed update),
ps_offload.daemon.store.master_pull (master pulls of a shard on NVMe, read from disk without loading it).

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

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ps_offload.daemon.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    PsError,
    StorageError,
)
from ps_offload.daemon.model.spec import ModelSpec, spec_difference, spec_from_dict, validate_spec
from ps_offload.daemon.store import push_kinds, snapshot_admin
from ps_offload.daemon.store.drop import Dropped, release_sums, stop_using
from ps_offload.daemon.store.limits import StoreLimits, arena_bytes, check_model_count, check_plan_size, check_ram
from ps_offload.daemon.store.master_pull import Scratch, pull_master
from ps_offload.daemon.store.persistence import create_files, load_into
from ps_offload.daemon.store.prefetch import Prefetcher
from ps_offload.daemon.store.pull import PullRequest
from ps_offload.daemon.store.pull_rounding import check_pull_dtype, element_bytes, rounded
from ps_offload.daemon.store.pull_wait import PullWait
from ps_offload.daemon.store.push import PushRequest, PushResult, check_step_locked
from ps_offload.daemon.store.replica_reports import ReplicaHealth, ReplicaReports
from ps_offload.daemon.store.shard import Shard, allocate_arena
from ps_offload.daemon.store.speculation import SpareArenas
from ps_offload.daemon.store.stats import StatsSnapshot, StoreStats, tier_counts
from ps_offload.daemon.tiers.accumulator_files import AccumulatorFiles
from ps_offload.daemon.tiers.nvme import NvmeFiles
from ps_offload.daemon.tiers.ram import RamTier
from ps_offload.daemon.tiers.ram_only import NoShardFiles, RamOnlyTier, RamSums
from ps_offload.daemon.tiers.tier import ResidencyTier, ShardFiles, SumStore
from ps_offload.optimizers import plugin_of
from ps_offload.proto.plan import (
    ParamLayout,
    ShardSlice,
    layout_params,
    plan_model,
)

log = logging.getLogger(__name__)

DROPPED_REMEMBERED = 1024


@dataclass
class RegisteredModel:
    spec: ModelSpec
    daemon_index: int
    layouts: list[ParamLayout]
    plan: list[ShardSlice]
    shards: dict[int, Shard]  # only the shards this daemon owns


class ShardStore:
    def __init__(
        self,
        *,
        ram_bytes: int,
        default_shard_bytes: int,
        files: NvmeFiles | None = None,
        prefetch_depth: int = 2,
        limits: StoreLimits | None = None,
        allow_nonfinite_pushes: bool = False,
        speculation_bytes: int = 0,
    ) -> None:
        """`speculation_bytes`: spare arenas for steps computed while backward runs
        (ps_offload.daemon.store.speculation); 0: none, every part waits for its APPLY."""
        self.ram_bytes = ram_bytes
        # Read by the fronts before a push is applied (ps_offload.daemon.rpc.data_path).
        self.allow_nonfinite_pushes = allow_nonfinite_pushes
        # Checked before a registration does any work (ps_offload.daemon.store.limits).
        self.limits = limits or StoreLimits()
        # The tiers (ps_offload.daemon.tiers.tier), chosen here once: past this point the store
        # asks `self.files.at_rest` only where the two kinds of daemon behave differently.
        self.files: ShardFiles
        self.tier: ResidencyTier
        self.accumulators: SumStore  # sums of steps pushed in parts (ps_offload.daemon.store.accumulate)
        if files is None:  # RAM only: every shard resident for good, nothing survives a restart
            self.files, self.tier, self.accumulators = NoShardFiles(), RamOnlyTier(), RamSums()
            prefetch_depth = 0  # nothing to load ahead: no order worth learning
        else:
            self.files = files
            self.tier = RamTier(budget=ram_bytes, allocate=allocate_arena, load=functools.partial(load_into, files))
            self.accumulators = AccumulatorFiles(files.dir)  # the page cache over unlinked files on NVMe
        self.prefetcher = Prefetcher(self.tier, depth=prefetch_depth)
        self.spares = SpareArenas(speculation_bytes, allocate_arena)
        self.default_shard_bytes = default_shard_bytes
        self.stats = StoreStats()
        self.replica_reports = ReplicaReports()  # trainers' word on lost holders (metrics)
        # Called with each shard's optimizer time, outside the store's locks (metrics).
        self.on_optimizer_step: Callable[[float], None] | None = None
        self._models: dict[str, RegisteredModel] = {}
        # Models recorded under nvme_dir that could not be recovered: name -> why (refused,
        # DATA_LOSS, while the daemon serves the others).
        self.damaged: dict[str, str] = {}
        self._dropping: set[str] = set()  # names being dropped: not to be registered meanwhile
        # Names dropped since the start (the last DROPPED_REMEMBERED) -> when: a call naming one
        # is told it was dropped, not that it was never registered.
        self._dropped: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()  # guards _models, damaged, _dropping, _dropped and stats counters

    # -- registration and recovery --------------------------------------------------------

    def register(self, spec: ModelSpec, daemon_index: int) -> tuple[RegisteredModel, bool]:
        """Creates the model's shards owned by `daemon_index`; returns (model, created)."""
        if not spec.shard_bytes:  # asks for this daemon's default
            spec = dataclasses.replace(spec, shard_bytes=self.default_shard_bytes)
        validate_spec(spec, daemon_index)
        check_plan_size(self.limits, spec)  # before a plan is built, under the lock below
        with self._lock:
            if spec.model in self.damaged:  # its files are still there: a new model must not replace them
                raise self._damaged_error(spec.model)
            if spec.model in self._dropping:  # its files are still open: a new model must not take their names
                raise FailedPrecondition(f"model {spec.model!r} is being dropped; register it again once that is done")
            existing = self._models.get(spec.model)
            if existing is not None:
                if existing.spec.identity() != spec.identity() or existing.daemon_index != daemon_index:
                    raise FailedPrecondition(
                        f"model {spec.model!r} is already registered with a different spec "
                        f"({spec_difference(existing.spec, spec, existing.daemon_index, daemon_index)}); "
                        "register it under a new name, or delete the old one first with `ps-admin drop "
                        f"{spec.model} --daemon ...` on every daemon it spans (a restart does not: it is recovered)"
                    )
                existing.spec = spec  # same identity; the addresses may be new
                return existing, False
            check_model_count(self.limits, len(self._models), spec.model)
            plan = self._plan(spec)
            # Before any arena exists (the new model is not in _models yet):
            used = None if self.files.at_rest else self._resident_bytes_locked()
            check_ram(spec.model, arena_bytes(plan, daemon_index, spec), ram_bytes=self.ram_bytes, used=used)
            registered = self._build(spec, daemon_index, plan)
            create_files(self.files, spec, daemon_index, registered.shards)
            self._models[spec.model] = registered
            self._dropped.pop(spec.model, None)  # a new model of that name
            return registered, True

    @staticmethod
    def _plan(spec: ModelSpec) -> list[ShardSlice]:
        layouts = layout_params([(p.name, p.shape, p.weight_decay) for p in spec.params])
        return plan_model(
            layouts, [p.starts_shard for p in spec.params], spec.shard_bytes, len(spec.daemons), spec.replicas,
            whole_params=plugin_of(spec.optimizer).whole_params,
        )  # fmt: skip

    def _build(self, spec: ModelSpec, daemon_index: int, plan: list[ShardSlice] | None = None) -> RegisteredModel:
        layouts = layout_params([(p.name, p.shape, p.weight_decay) for p in spec.params])
        plan = plan if plan is not None else self._plan(spec)
        groups = tuple(p.group for p in spec.params)
        shards = {
            s.shard_id: Shard(
                spec.model,
                s,
                layouts,
                spec.optimizer,
                persistent=self.files.at_rest,
                param_groups=groups,
                sums=self.accumulators,
                state_dtype=spec.state_dtype,
            )  # fmt: skip
            for s in plan
            if daemon_index in s.holders
        }
        return RegisteredModel(spec, daemon_index, layouts, plan, shards)

    def recover(self) -> int:
        """Rebuilds every model recorded under nvme_dir, each shard at its last committed
        version; a shard whose bytes fail their checksum is kept but refused (DATA_LOSS).
        Returns the number of shards recovered."""
        recovered = 0
        damaged: dict[str, str] = {}
        for spec, daemon_index, layout in self.files.recorded_models(damaged, parse=spec_from_dict):
            try:
                model = self._build(spec, daemon_index)
                # Headers only: a model may be larger than RAM. The bytes are read, and their
                # checksum verified, when the shard is first used.
                headers, rolled_back = self.files.open_model(spec, layout, set(model.shards))
            except (OSError, ValueError, PsError) as exc:  # its arena is missing, short or unreadable
                self.files.forget(spec.model)
                damaged[spec.model] = (
                    f"its arena file {self.files.arena_path(spec.model)} cannot be opened or read ({exc})"
                )
                continue
            for shard_id, shard in model.shards.items():
                header = headers.get(shard_id)
                if header is not None:
                    shard.set_version(header.version, initialized=header.initialized)
                if shard_id in rolled_back:
                    shard.corrupt = f"shard {shard_id} of model {spec.model!r}: {rolled_back[shard_id]}"
                    shard.rolled_back = True
                    log.error("%s", shard.corrupt)
                recovered += 1
            with self._lock:
                self._models[spec.model] = model
        for name, why in damaged.items():
            log.error("model %r could not be recovered and is refused until its files are fixed: %s", name, why)
        with self._lock:
            self.damaged = damaged
        return recovered

    def _resident_bytes_locked(self) -> int:
        """RAM held by shards: resident arenas, plus the tier's pooled buffers, plus the sums
        of steps pushed in parts when they are in RAM (not bounded by the tier's budget; with
        an NVMe tier they are on it: ps_offload.daemon.store.accumulate)."""
        shards = [s for m in self._models.values() for s in m.shards.values()]
        parts = sum(s.parts.nbytes for s in shards if s.parts.in_ram)
        return self.tier.resident_bytes(shards) + parts

    # -- lookup -------------------------------------------------------------------------

    def model(self, name: str) -> RegisteredModel:
        model = self._models.get(name)
        if model is None and name in self.damaged:
            raise self._damaged_error(name)
        if model is None and name in self._dropped:
            ago = time.time() - self._dropped[name]
            raise NotFound(
                f"model {name!r} was dropped from this daemon {ago:.0f}s ago (ps-admin drop): its parameters and "
                "optimizer state are gone; register it again to start it over"
            )
        if model is None:
            known = ", ".join(sorted(self._models)) or "none"
            raise NotFound(f"model {name!r} is not registered on this daemon (registered: {known})")
        return model

    def _damaged_error(self, name: str) -> DataLoss:
        return DataLoss(
            f"model {name!r} could not be recovered at start: {self.damaged[name]}. The daemon serves its other "
            "models; restore this one's files (or move them out of nvme_dir) and restart the daemon"
        )

    def shard(self, model_name: str, shard_id: int) -> Shard:
        model = self.model(model_name)
        shard = model.shards.get(shard_id)
        if shard is None:
            if shard_id < len(model.plan):
                holders = model.plan[shard_id].holders
                where = ", ".join(f"daemon {i} ({model.spec.daemons[i]})" for i in holders)
                raise NotFound(
                    f"shard {shard_id} of model {model_name!r} lives on {where}, not on this one "
                    f"(daemon {model.daemon_index})"
                )
            raise NotFound(f"model {model_name!r} has shards 0..{len(model.plan) - 1}; there is no shard {shard_id}")
        if shard.corrupt:
            raise DataLoss(shard.corrupt)
        return shard

    def models(self) -> list[RegisteredModel]:
        with self._lock:
            return list(self._models.values())

    # -- data path ----------------------------------------------------------------------

    @contextlib.contextmanager
    def pull(
        self,
        pull: PullRequest,
        *,
        timeout: float,
        scratch: Scratch | None = None,
        waiting: PullWait | None = None,
        waited: float | None = None,
    ) -> Iterator[tuple[torch.Tensor, int]]:
        """Holds the shard for reading at pull.min_version or later: yields (its `pull.tensor`,
        version), the tensor one of SHARD_TENSORS. The caller streams the tensor inside the block.
        `pull.dtype` bfloat16 or float16 (master only; ps_offload.daemon.store.pull_rounding): yields the master
        values rounded under the hold into a buffer from `scratch(n)` (as push's), and the
        hold ends there. With an NVMe tier, the master values of a shard that is not resident
        are read from disk into a buffer from `scratch`, without loading the shard
        (ps_offload.daemon.store.master_pull), and the hold ends there too. `waiting`: a gRPC pull's bound
        on waiting for the version (ps_offload.daemon.store.pull_wait); `waited`: how long the caller has
        waited already (for the message if the version is still not there). Not for pull.snapshot
        (pull_snapshot)."""
        shard = self._pullable(pull)
        shard.await_version(pull.min_version, timeout, waiting, waited=waited)  # the wait, without holding anything
        with contextlib.ExitStack() as sending:
            yield self._pulled(sending, shard, pull, timeout, scratch)
        with self._lock:
            self.stats.pulls += 1
            self.stats.bytes_pulled += shard.slice.numel * element_bytes(pull.dtype)  # the bytes sent

    def _pullable(self, pull: PullRequest) -> Shard:
        shard = self.shard(pull.model, pull.shard_id)
        shard.check_tensor(pull.tensor)
        check_pull_dtype(pull.dtype, pull.tensor, pull.where, shard.state_dtype)
        return shard

    def pull_waits_on(self, pull: PullRequest) -> Shard | None:
        """Checks a pull as pull does (raising what pull would); the shard it would wait on for
        its version, or None when it can go on now (a snapshot's copy never waits, and is
        checked when it is read). For a pull that must not hold a thread while it waits (the
        data plane's parks on the shard: Shard.watch)."""
        if pull.snapshot:
            return None
        shard = self._pullable(pull)
        with shard.cond:
            return None if shard.dropped or shard.ready_locked(pull.min_version) else shard

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

    def check_push(self, push: PushRequest) -> PushResult | None:
        """Validates a push before its payload is read (`push.data` None: its announced
        `nbytes`). Returns the acknowledgement for a push that was applied before (no payload
        needed; counted as a duplicate), else None."""
        shard = self.shard(push.model, push.shard_id)
        push.check_shard(shard)
        model = self.model(push.model)
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
        return ack

    def push(
        self,
        push: PushRequest,
        *,
        scratch: Scratch | None = None,
        pull_into: torch.Tensor | None = None,
    ) -> PushResult:
        """Applies a gradient or a momentum (1-bit Adam), or writes initial values, held in
        `push.data`: fp32 with the shard's numel, or compressed (ps_offload.daemon.model.encodings); adds a
        GRADIENT_PART to the step's sum, or applies that sum (APPLY, no data).
        Compressed values that the optimizer does not take as they are (all but a ONEBIT
        momentum, TOPK and ONEBIT gradients) are first decompressed into an fp32 buffer from
        `scratch(numel)` (a StagingPool's borrow; a fresh tensor if None). Everything is checked
        before the shard changes. Each kind is one function of ps_offload.daemon.store.push_kinds.
        `pull_into` (GRADIENT and APPLY; checked by the caller: the shard's numel, fp32, bf16 or
        fp16): gets the new version as a pull would write it, in the update's own pass
        (PushResult.pulled); other kinds leave it alone."""
        if push.data is None and push.kind != "apply":
            raise ValueError("push() needs the payload (PushRequest.with_data)")
        shard = self.shard(push.model, push.shard_id)
        push.check_shard(shard)
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
        with self._lock:
            models = {n: (m.plan, m.daemon_index) for n, m in self._models.items() if m.spec.replicas > 1}
        return self.replica_reports.health(models)

    def prefetch(self, model: str, shard_ids: list[int]) -> int:
        """A trainer's hint: these shards next, in this order. Queued for loading into the
        RAM tier (bounded by its free room); returns how many were queued."""
        shards = [self.shard(model, shard_id) for shard_id in shard_ids]
        with self._lock:
            self.stats.prefetch_hints += len(shard_ids)
        return self.prefetcher.hint(shards)

    # -- tiers ----------------------------------------------------------------------------

    def _using(self, shard: Shard, *, pull: bool = False) -> contextlib.AbstractContextManager[None]:
        """Pins the shard in RAM for the block (loading it if it was on NVMe; TierFull, a
        ResourceExhausted, when the tier has no room for it in time). `pull`: a read, after
        which the shard's push is still to come (the tier keeps it upcoming)."""
        return self.tier.use(shard, pull=pull)

    def stats_snapshot(self) -> StatsSnapshot:
        with self._lock:
            s = self.stats
            shards = [shard for model in self._models.values() for shard in model.shards.values()]
            return StatsSnapshot(
                models=len(self._models),
                shards=len(shards),
                ram_bytes_used=self._resident_bytes_locked(),
                bytes_pulled=s.bytes_pulled,
                bytes_pushed=s.bytes_pushed,
                pulls=s.pulls,
                pulls_carried=s.pulls_carried,
                pushes_applied=s.pushes_applied,
                pushes_duplicate=s.pushes_duplicate,
                optimizer_seconds=s.optimizer_seconds,
                prefetch_hints=s.prefetch_hints,
                uptime_seconds=time.monotonic() - s.started,
                speculative_steps=self.spares.committed,
                speculative_redone=self.spares.discarded,
                speculation_bytes=self.spares.bytes,
                **tier_counts(self.files, self.tier, self.ram_bytes, shards),
            )

    def drop(self, name: str, *, timeout: float = 60.0) -> Dropped:
        """Deletes a model from this daemon (ps_offload.daemon.store.drop says in what order, and why)."""
        with self._lock:
            if name in self._dropping:
                raise FailedPrecondition(f"model {name!r} is already being dropped")
            if name in self.damaged:  # nothing of it is open: its files go
                disk = self.files.delete_model(name)
                del self.damaged[name]
                log.warning("model %r (damaged) dropped: %d bytes of files deleted", name, disk)
                self._remember_dropped_locked(name)
                return Dropped(0, disk, 0, was_damaged=True)
            model = self.model(name)
            self._dropping.add(name)
            del self._models[name]
        try:
            shards = list(model.shards.values())
            if not stop_using(shards, timeout):
                with self._lock:
                    self._models[name] = model
                raise DeadlineExceeded(
                    f"model {name!r}: a push or pull still held one of its shards after {timeout:.0f}s; nothing was "
                    "dropped. Stop its trainers and try again"
                )
            ram = release_sums(shards)
            self.spares.trim()
            try:
                ram += self.tier.forget(shards, timeout)
            except TimeoutError as exc:
                raise StorageError(
                    f"model {name!r} was dropped from memory, but {exc}; its files stay until the daemon "
                    "restarts (it is then recovered; drop it again)"
                ) from exc
            disk = self.files.delete_model(name)
        finally:
            with self._lock:
                self._dropping.discard(name)
                if name not in self._models:
                    self._remember_dropped_locked(name)
        self.replica_reports.forget(name)
        log.warning("model %r dropped: %d shards, %d bytes of RAM and %d of files freed", name, len(shards), ram, disk)
        return Dropped(len(shards), disk, ram, was_damaged=False)

    def _remember_dropped_locked(self, name: str) -> None:
        self._dropped[name] = time.time()
        self._dropped.move_to_end(name)
        while len(self._dropped) > DROPPED_REMEMBERED:
            self._dropped.popitem(last=False)

    # -- snapshots (taken, listed and deleted by ps_offload.daemon.store.snapshot_admin) -----

    def pull_snapshot(self, model: str, shard_id: int, name: str, tensor: str = "master") -> tuple[torch.Tensor, int]:
        """(`tensor` of the shard as snapshot `name` holds it, the snapshot's step): a copy of
        this pull's own, read from the snapshot's slot."""
        shard = self.shard(model, shard_id)
        shard.check_tensor(tensor)
        values, step = snapshot_admin.read_tensor(self.files, shard, name, tensor)
        with self._lock:
            self.stats.pulls += 1
            self.stats.bytes_pulled += values.numel() * 4
        return values, step

    def close(self) -> None:
        self.tier.close()
