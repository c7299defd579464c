"""Shards held by one daemon: registration, recovery, pull, push with (shard, step) dedup,
commit. The pieces it composes: ps_offload.daemon.model.spec (what a model is), ps_offload.daemon.store.shard (one
shard and its hold), ps_offload.daemon.store.push (one push, validated), ps_offload.daemon.store.prefetch (what to load
ahead), ps_offload.daemon.store.inspection (admin statistics and verify), ps_offload.daemon.tiers (RAM over NVMe),
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
    ResourceExhausted,
    StorageError,
)
from ps_offload.daemon.model.encodings import OneBitGradient
from ps_offload.daemon.model.spec import ModelSpec, spec_difference, spec_from_dict, validate_spec
from ps_offload.daemon.store import inspection, snapshot_admin
from ps_offload.daemon.store.accumulate import add_part
from ps_offload.daemon.store.drop import Dropped, release_sums, stop_using
from ps_offload.daemon.store.inspection import StatsSnapshot, StoreStats, ValueStats, Verdict
from ps_offload.daemon.store.limits import StoreLimits, arena_bytes, check_model_count, check_plan_size, check_ram
from ps_offload.daemon.store.master_pull import pull_master
from ps_offload.daemon.store.persistence import commit, create_files, load_into, roll_back
from ps_offload.daemon.store.prefetch import Prefetcher
from ps_offload.daemon.store.pull_rounding import check_pull_dtype, element_bytes, rounded
from ps_offload.daemon.store.pull_wait import PullWait
from ps_offload.daemon.store.push import PushRequest, PushResult, check_step_locked
from ps_offload.daemon.store.shard import (
    Shard,
    allocate_arena,
)
from ps_offload.daemon.tiers.accumulator_files import AccumulatorFiles
from ps_offload.daemon.tiers.nvme import NvmeFiles
from ps_offload.daemon.tiers.ram import RamTier, TierFull
from ps_offload.proto.plan import ParamLayout, ShardSlice, layout_params, plan_shards, shard_numel_for, shard_starts

log = logging.getLogger(__name__)


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
    ) -> None:
        self.ram_bytes = ram_bytes
        self.limits = (
            limits or StoreLimits()
        )  # checked before a registration does any work (ps_offload.daemon.store.limits)
        self.files = files  # None: RAM only, nothing survives a restart
        self.tier = (
            RamTier(budget=ram_bytes, allocate=allocate_arena, load=functools.partial(load_into, files))
            if files is not None
            else None
        )
        self.prefetcher = Prefetcher(self.tier, depth=prefetch_depth)
        # Sums of steps pushed in parts: on the NVMe tier when there is one (page cache over
        # unlinked files), in RAM otherwise (ps_offload.daemon.store.accumulate).
        self.accumulators = AccumulatorFiles(files.dir) if files is not None else None
        self.default_shard_bytes = default_shard_bytes
        self.stats = StoreStats()
        # Called with each shard's optimizer time, outside the store's locks (metrics).
        self.on_optimizer_step: Callable[[float], None] | None = None
        self._models: dict[str, RegisteredModel] = {}
        # Models recorded under nvme_dir that could not be recovered: name -> why (refused,
        # DATA_LOSS, while the daemon serves the others).
        self.damaged: dict[str, str] = {}
        self._dropping: set[str] = set()  # names being dropped: not to be registered meanwhile
        self._lock = threading.Lock()  # guards _models, damaged, _dropping and stats counters

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
                        "register it under a new name, or restart the daemon to drop it"
                    )
                existing.spec = spec  # same identity; the addresses may be new
                return existing, False
            check_model_count(self.limits, len(self._models), spec.model)
            plan = self._plan(spec)
            # Before any arena exists (the new model is not in _models yet):
            used = None if self.tier is not None else self._resident_bytes_locked()
            check_ram(spec.model, arena_bytes(plan, daemon_index, spec), ram_bytes=self.ram_bytes, used=used)
            registered = self._build(spec, daemon_index, plan)
            if self.files is not None:
                create_files(self.files, spec, daemon_index, registered.shards)
            self._models[spec.model] = registered
            return registered, True

    @staticmethod
    def _plan(spec: ModelSpec) -> list[ShardSlice]:
        layouts = layout_params([(p.name, p.shape, p.weight_decay) for p in spec.params])
        total = sum(p.numel for p in layouts)
        starts = shard_starts(layouts, [p.starts_shard for p in spec.params])
        return plan_shards(total, shard_numel_for(spec.shard_bytes), len(spec.daemons), starts)

    def _build(self, spec: ModelSpec, daemon_index: int, plan: list[ShardSlice] | None = None) -> RegisteredModel:
        layouts = layout_params([(p.name, p.shape, p.weight_decay) for p in spec.params])
        plan = plan if plan is not None else self._plan(spec)
        persistent = self.files is not None
        groups = tuple(p.group for p in spec.params)
        shards = {
            s.shard_id: Shard(
                spec.model,
                s,
                layouts,
                spec.optimizer,
                persistent=persistent,
                param_groups=groups,
                allocate_sum=self.accumulators.allocate if self.accumulators is not None else None,
            )  # fmt: skip
            for s in plan
            if s.daemon_index == daemon_index
        }
        return RegisteredModel(spec, daemon_index, layouts, plan, shards)

    def recover(self) -> int:
        """Rebuilds every model recorded under nvme_dir, each shard at its last committed
        version; a shard whose bytes fail their checksum is kept but refused (DATA_LOSS).
        Returns the number of shards recovered."""
        if self.files is None:
            return 0
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
        if self.tier is not None:
            return self.tier.used + self.tier.pooled + parts
        return sum(s.resident_bytes for s in shards) + parts

    # -- lookup -------------------------------------------------------------------------

    def model(self, name: str) -> RegisteredModel:
        model = self._models.get(name)
        if model is None and name in self.damaged:
            raise self._damaged_error(name)
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
                owner = model.plan[shard_id].daemon_index
                raise NotFound(
                    f"shard {shard_id} of model {model_name!r} lives on daemon {owner} "
                    f"({model.spec.daemons[owner]}), not on this one (daemon {model.daemon_index})"
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
        model: str,
        shard_id: int,
        *,
        min_version: int,
        timeout: float,
        tensor: str = "master",
        dtype: str = "float32",
        scratch: Callable[[int], contextlib.AbstractContextManager[torch.Tensor]] | None = None,
        waiting: PullWait | None = None,
        waited: float | None = None,
    ) -> Iterator[tuple[torch.Tensor, int]]:
        """Holds the shard for reading at min_version or later: yields (its `tensor`, version),
        the tensor one of SHARD_TENSORS. The caller streams the tensor inside the block.
        `dtype` bfloat16 or float16 (master only; ps_offload.daemon.store.pull_rounding): yields the master
        values rounded under the hold into a buffer from `scratch(n)` (as push's), and the
        hold ends there. With an NVMe tier, the master values of a shard that is not resident
        are read from disk into a buffer from `scratch`, without loading the shard
        (ps_offload.daemon.store.master_pull), and the hold ends there too. `waiting`: a gRPC pull's bound
        on waiting for the version (ps_offload.daemon.store.pull_wait); `waited`: how long the caller has
        waited already (for the message if the version is still not there)."""
        shard = self._pullable(model, shard_id, tensor, dtype)
        shard.await_version(min_version, timeout, waiting, waited=waited)  # the wait, without holding anything
        with contextlib.ExitStack() as sending:
            yield self._pulled(sending, shard, tensor, dtype, min_version, timeout, scratch)
        with self._lock:
            self.stats.pulls += 1
            self.stats.bytes_pulled += shard.slice.numel * element_bytes(dtype)  # the bytes sent

    def _pullable(self, model: str, shard_id: int, tensor: str, dtype: str) -> Shard:
        shard = self.shard(model, shard_id)
        shard.check_tensor(tensor)
        check_pull_dtype(dtype, tensor, f"pull of shard {shard_id} of model {model!r}")
        return shard

    def pull_waits_on(self, model: str, shard_id: int, *, min_version: int, tensor: str, dtype: str) -> Shard | None:
        """Checks a pull as pull does (raising what pull would); the shard it would wait on for
        its version, or None when it can go on now. For a pull that must not hold a thread
        while it waits (the data plane's parks on the shard: Shard.watch)."""
        shard = self._pullable(model, shard_id, tensor, dtype)
        with shard.cond:
            return None if shard.dropped or shard.ready_locked(min_version) else shard

    def _pulled(
        self,
        sending: contextlib.ExitStack,
        shard: Shard,
        tensor: str,
        dtype: str,
        min_version: int,
        timeout: float,
        scratch: Callable[[int], contextlib.AbstractContextManager[torch.Tensor]] | None,
    ) -> tuple[torch.Tensor, int]:
        """pull's (values, version), with what must last while they are sent entered on `sending`."""
        if tensor == "master" and self.tier is not None:
            pulled = pull_master(
                sending, self.files, self.tier, shard, min_version=min_version, timeout=timeout, dtype=dtype,
                scratch=scratch,
            )  # fmt: skip
            if pulled is not None:
                return pulled
        if dtype == "float32":
            sending.enter_context(self._using(shard))
            return shard.tensor(tensor), sending.enter_context(shard.reading(min_version, timeout))
        with self._using(shard), shard.reading(min_version, timeout) as version:
            # The rounded copy is this pull's own: the next update need not wait for the send.
            return sending.enter_context(rounded(shard.master, dtype, scratch)), version

    def check_push(self, push: PushRequest) -> PushResult | None:
        """Validates a push before its payload is read (`push.data` None: its announced
        `nbytes`). Returns the acknowledgement for a push that was applied before (no payload
        needed; counted as a duplicate), else None."""
        shard = self.shard(push.model, push.shard_id)
        push.check_shard(shard)
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
        scratch: Callable[[int], contextlib.AbstractContextManager[torch.Tensor]] | None = None,
    ) -> PushResult:
        """Applies a gradient or a momentum (1-bit Adam), or writes initial values, held in
        `push.data`: fp32 with the shard's numel, or compressed (ps_offload.daemon.model.encodings); adds a
        GRADIENT_PART to the step's sum, or applies that sum (APPLY, no data).
        Compressed values that the optimizer does not take as they are (all but a ONEBIT
        momentum) are first decompressed, and a gradient with a grad_multiplier multiplied,
        into an fp32 buffer from `scratch(numel)` (a StagingPool's borrow; a fresh tensor if
        None): PushRequest.values. Everything is checked before the shard changes."""
        if push.data is None and push.kind != "apply":
            raise ValueError("push() needs the payload (PushRequest.with_data)")
        shard = self.shard(push.model, push.shard_id)
        push.check_shard(shard)
        numel = shard.slice.numel
        with contextlib.ExitStack() as held:

            def borrow() -> torch.Tensor:
                return held.enter_context(scratch(numel)) if scratch else torch.empty(numel, dtype=torch.float32)

            if push.check_only:  # an APPLY's check: the parts are all held (else it raises)
                with shard.cond:
                    ack = check_step_locked(shard, push)
                with shard.parts.lock:
                    if ack is None:
                        shard.parts.check_count_locked(push)
                return ack or PushResult(applied=False, version=shard.version)
            if push.kind == "gradient_part":  # no update, nor the shard's values: its sum only
                result = add_part(shard, push, borrow)
                with self._lock:
                    if result.applied:
                        self.stats.bytes_pushed += push.payload_bytes
                    else:
                        self.stats.pushes_duplicate += 1
                return result
            # Outside the shard's lock: the payload and the buffer are this push's own.
            data = None if push.kind == "apply" else push.values(borrow)
            push.check_state(shard)
            if push.kind not in ("parameters", "state"):
                # (.get: the model may have been dropped since; its shards then end NOT_FOUND below)
                self.prefetcher.pushed(shard, push.step, lambda: getattr(self._models.get(shard.model), "shards", {}))
            with self._using(shard), shard.writing_lock(), shard.parts.lock:
                # Re-checked under the lock: a retry may have raced the first attempt.
                ack = check_step_locked(shard, push)
                if ack is not None:
                    with self._lock:
                        self.stats.pushes_duplicate += 1
                    return ack
                if push.kind == "parameters":
                    shard.master.copy_(data)
                    shard.initialized = True
                    commit(self.files, shard)
                elif push.kind == "state":
                    _restore_state(shard, data, push.step)
                    commit(self.files, shard)
                else:
                    if push.kind == "apply":
                        data = shard.parts.gradient_locked(push, borrow)
                    elapsed = self._update(shard, push, data)
                    commit(self.files, shard)
                    shard.parts.drop_applied_locked(shard.version)  # committed: the parts are spent
                    with self._lock:
                        self.stats.optimizer_seconds += elapsed
                        self.stats.pushes_applied += 1
                    if self.on_optimizer_step is not None:
                        self.on_optimizer_step(elapsed)
                with self._lock:
                    self.stats.bytes_pushed += push.payload_bytes
                return PushResult(applied=True, version=shard.version)

    def _update(self, shard: Shard, push: PushRequest, data: torch.Tensor | OneBitGradient) -> float:
        """One optimizer step on a shard held for writing (its version advances); returns
        the seconds it took."""
        started = time.perf_counter()
        lr = shard.optimizer.config.lr if push.lr is None else push.lr
        try:
            if push.kind == "momentum":
                shard.optimizer.apply_momentum(shard.master, data, lr, push.variance_frozen_at)
            else:
                shard.optimizer.apply(shard.master, data, lr, push.groups)
        except BaseException:
            roll_back(self.files, shard)  # validation should leave nothing to fail here; a kernel did
            raise
        shard.version += 1
        return time.perf_counter() - started

    def prefetch(self, model: str, shard_ids: list[int]) -> int:
        """A trainer's hint: these shards next, in this order. Queued for loading into the
        RAM tier (bounded by its free room); returns how many were queued."""
        shards = [self.shard(model, shard_id) for shard_id in shard_ids]
        with self._lock:
            self.stats.prefetch_hints += len(shard_ids)
        return self.prefetcher.hint(shards)

    # -- tiers and admin ------------------------------------------------------------------

    def evict(self, model: str, shard_id: int) -> Shard:
        """Drops a shard from RAM; it stays committed on disk."""
        shard = self.shard(model, shard_id)
        if self.tier is None:
            raise FailedPrecondition("this daemon has no NVMe tier (store.nvme_dir); shards cannot leave RAM")
        if not self.tier.evict(shard):
            raise FailedPrecondition(f"shard {shard_id} of model {model!r} is in use; try again")
        return shard

    def load(self, model: str, shard_id: int) -> Shard:
        """Reads a shard into RAM now (it stays until evicted by need or by `evict`)."""
        shard = self.shard(model, shard_id)
        with self._using(shard):
            return shard

    def _using(self, shard: Shard):
        """Pins the shard in RAM for the block (loading it if it was on NVMe)."""
        if self.tier is None:
            return contextlib.nullcontext()
        return _tier_errors(self.tier.use(shard))

    def value_stats(self, shard: Shard, *, timeout: float = 10.0, bins: int = 0) -> ValueStats:
        """ps_offload.daemon.store.inspection.value_stats, with the shard brought into RAM for the while."""
        with self._using(shard):
            return inspection.value_stats(shard, timeout=timeout, bins=bins)

    def shards_to_verify(self, model: str = "") -> list[Shard]:
        """The named model's shards (NotFound if unknown), or every model's (""), in name and
        id order."""
        models = [self.model(model)] if model else sorted(self.models(), key=lambda m: m.spec.model)
        return [m.shards[i] for m in models for i in sorted(m.shards)]

    def verify_bytes(self, shards: list[Shard]) -> int:
        return inspection.verify_bytes(self.files, shards)

    def verify(self, shards: list[Shard], *, hold_timeout: float = 60.0) -> Iterator[Verdict]:
        """ps_offload.daemon.store.inspection.verify over this store's files."""
        return inspection.verify(self.files, shards, hold_timeout=hold_timeout)

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
                pushes_applied=s.pushes_applied,
                pushes_duplicate=s.pushes_duplicate,
                optimizer_seconds=s.optimizer_seconds,
                prefetch_hints=s.prefetch_hints,
                uptime_seconds=time.monotonic() - s.started,
                **inspection.tier_counts(self.files, self.tier, self.ram_bytes, shards),
            )

    def drop(self, name: str, *, timeout: float = 60.0) -> Dropped:
        """Deletes a model from this daemon (ps_offload.daemon.store.drop says in what order, and why)."""
        with self._lock:
            if name in self._dropping:
                raise FailedPrecondition(f"model {name!r} is already being dropped")
            if name in self.damaged:  # nothing of it is open: its files go
                disk = self.files.delete_model(name) if self.files is not None else 0
                del self.damaged[name]
                log.warning("model %r (damaged) dropped: %d bytes of files deleted", name, disk)
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
            if self.tier is not None:
                try:
                    ram += self.tier.forget(shards, timeout)
                except TimeoutError as exc:
                    raise StorageError(
                        f"model {name!r} was dropped from memory, but {exc}; its files stay until the daemon "
                        "restarts (it is then recovered; drop it again)"
                    ) from exc
            else:
                ram += sum(s.resident_bytes for s in shards)
                for shard in shards:
                    shard.detach()
            disk = self.files.delete_model(name) if self.files is not None else 0
        finally:
            with self._lock:
                self._dropping.discard(name)
        log.warning("model %r dropped: %d shards, %d bytes of RAM and %d of files freed", name, len(shards), ram, disk)
        return Dropped(len(shards), disk, ram, was_damaged=False)

    # -- snapshots (ps_offload.daemon.store.snapshot_admin) ------------------------------------------------------

    def create_snapshot(
        self, model: str, name: str, step: int, *, timeout: float, caller_left: threading.Event | None = None
    ) -> snapshot_admin.SnapshotInfo:
        shard_ids = set(self.model(model).shards)
        return snapshot_admin.take(self.files, model, name, step, shard_ids, timeout, caller_left)

    def wake_snapshots(self, model: str) -> None:
        snapshot_admin.wake(self.files, model)

    def list_snapshots(self, model: str) -> list[snapshot_admin.SnapshotInfo]:
        self.model(model)  # NotFound for a model not here
        return snapshot_admin.listed(self.files, model)

    def delete_snapshot(self, model: str, name: str) -> snapshot_admin.SnapshotInfo:
        self.model(model)
        return snapshot_admin.delete(self.files, model, name)

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
        if self.tier is not None:
            self.tier.close()


def _restore_state(shard: Shard, values: torch.Tensor, step: int) -> None:
    """A STATE push, under the shard's write hold: master and optimizer state from `values`
    (checked by the push), the shard at version `step`."""
    numel = shard.slice.numel
    for index, tensor in enumerate([shard.master, *shard.optimizer.state]):
        tensor.copy_(values[index * numel : (index + 1) * numel])
    shard.set_version(step, initialized=True)


@contextlib.contextmanager
def _tier_errors(use):
    try:
        with use:
            yield
    except TierFull as exc:
        raise ResourceExhausted(str(exc)) from exc
