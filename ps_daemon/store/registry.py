"""The models this daemon holds: register, recover, look up, drop. The data path
(ps_offload.daemon.store.shard_store) asks it for a shard once per request and never changes
which models there are; only these four operations do, under the registry's own lock.

A model's shards are built here (ps_offload.daemon.store.shard.Shard over the plan every side
computes: ps_offload.proto.plan.plan_model) and its files created or opened through the tier
roles it is given (ps_offload.daemon.tiers.tier.Tiers), whichever tiers the composition root
chose. A name can be registered, recorded damaged at start (refused, DATA_LOSS, while the
daemon serves the others), being dropped, or dropped (remembered, so a call naming it is told
so rather than that it never existed).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ps_offload.daemon.errors import DataLoss, DeadlineExceeded, FailedPrecondition, NotFound, PsError, StorageError
from ps_offload.daemon.model.spec import ModelSpec, spec_difference, spec_from_dict, validate_spec
from ps_offload.daemon.store.drop import Dropped, release_sums, stop_using
from ps_offload.daemon.store.limits import StoreLimits, arena_bytes, check_model_count, check_plan_size, check_ram
from ps_offload.daemon.store.persistence import create_files
from ps_offload.daemon.store.shard import Shard
from ps_offload.daemon.tiers.tier import Tiers
from ps_offload.optimizers import plugin_of
from ps_offload.proto.plan import ParamLayout, ShardSlice, layout_params, plan_model

log = logging.getLogger(__name__)

DROPPED_REMEMBERED = 1024


@dataclass
class RegisteredModel:
    spec: ModelSpec
    daemon_index: int
    layouts: list[ParamLayout]
    plan: list[ShardSlice]
    shards: dict[int, Shard]  # only the shards this daemon owns


class ModelRegistry:
    def __init__(self, tiers: Tiers, *, ram_bytes: int, default_shard_bytes: int, limits: StoreLimits) -> None:
        self.tiers = tiers
        self.ram_bytes = ram_bytes
        self.default_shard_bytes = default_shard_bytes
        self.limits = limits  # checked before a registration does any work (ps_offload.daemon.store.limits)
        # What else forgets a dropped model once its shards are gone (the store's spare arenas
        # and replica reports), called with its name.
        self.on_drop: list[Callable[[str], None]] = []
        self._models: dict[str, RegisteredModel] = {}
        # Models recorded under nvme_dir that could not be recovered: name -> why.
        self.damaged: dict[str, str] = {}
        self._dropping: set[str] = set()  # names being dropped: not to be registered meanwhile
        # Names dropped since the start (the last DROPPED_REMEMBERED) -> when.
        self._dropped: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()  # guards _models, damaged, _dropping and _dropped

    # -- register and recover ---------------------------------------------------------------

    def register(self, spec: ModelSpec, daemon_index: int) -> tuple[RegisteredModel, bool]:
        """Creates the model's shards owned by `daemon_index`; returns (model, created)."""
        if not spec.shard_bytes:  # asks for this daemon's default
            spec = dataclasses.replace(spec, shard_bytes=self.default_shard_bytes)
        validate_spec(spec, daemon_index)
        check_plan_size(self.limits, spec)  # before a plan is built, under the lock below
        files = self.tiers.files
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
            used = None if files.at_rest else self._resident_bytes_locked()
            check_ram(spec.model, arena_bytes(plan, daemon_index, spec), ram_bytes=self.ram_bytes, used=used)
            registered = self._build(spec, daemon_index, plan)
            create_files(files, spec, daemon_index, registered.shards)
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
                persistent=self.tiers.files.at_rest,
                param_groups=groups,
                sums=self.tiers.sums,
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
        files = self.tiers.files
        recovered = 0
        damaged: dict[str, str] = {}
        for spec, daemon_index, layout in files.recorded_models(damaged, parse=spec_from_dict):
            try:
                model = self._build(spec, daemon_index)
                # Headers only: a model may be larger than RAM. The bytes are read, and their
                # checksum verified, when the shard is first used.
                headers, rolled_back = files.open_model(spec, layout, set(model.shards))
            except (OSError, ValueError, PsError) as exc:  # its arena is missing, short or unreadable
                files.forget(spec.model)
                damaged[spec.model] = f"its arena file {files.arena_path(spec.model)} cannot be opened or read ({exc})"
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

    def resident_bytes(self) -> int:
        with self._lock:
            return self._resident_bytes_locked()

    def _resident_bytes_locked(self) -> int:
        """RAM held by shards: resident arenas, plus the tier's pooled buffers, plus the sums
        of steps pushed in parts when they are in RAM (not bounded by the tier's budget; with
        an NVMe tier they are on it: ps_offload.daemon.store.accumulate)."""
        shards = [s for m in self._models.values() for s in m.shards.values()]
        parts = sum(s.parts.nbytes for s in shards if s.parts.in_ram)
        return self.tiers.residency.resident_bytes(shards) + parts

    # -- look up ----------------------------------------------------------------------------

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
        """The shard, if this daemon holds it and it is not damaged; else NotFound (saying
        which daemons hold it) or DataLoss."""
        return self.located(model_name, shard_id)[1]

    def located(self, model_name: str, shard_id: int) -> tuple[RegisteredModel, Shard]:
        """(its model, the shard), as `shard` finds it."""
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
        return model, shard

    def shards_of(self, name: str) -> dict[int, Shard]:
        """The model's shards held here; {} for a name not registered (or dropped meanwhile)."""
        model = self._models.get(name)
        return model.shards if model is not None else {}

    def models(self) -> list[RegisteredModel]:
        with self._lock:
            return list(self._models.values())

    # -- drop -------------------------------------------------------------------------------

    def drop(self, name: str, *, timeout: float = 60.0) -> Dropped:
        """Deletes a model from this daemon (ps_offload.daemon.store.drop says in what order, and why)."""
        files, residency = self.tiers.files, self.tiers.residency
        with self._lock:
            if name in self._dropping:
                raise FailedPrecondition(f"model {name!r} is already being dropped")
            if name in self.damaged:  # nothing of it is open: its files go
                disk = files.delete_model(name)
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
            try:
                ram += residency.forget(shards, timeout)
            except TimeoutError as exc:
                raise StorageError(
                    f"model {name!r} was dropped from memory, but {exc}; its files stay until the daemon "
                    "restarts (it is then recovered; drop it again)"
                ) from exc
            disk = files.delete_model(name)
        finally:
            with self._lock:
                self._dropping.discard(name)
                if name not in self._models:
                    self._remember_dropped_locked(name)
        for forget in self.on_drop:
            forget(name)
        log.warning("model %r dropped: %d shards, %d bytes of RAM and %d of files freed", name, len(shards), ram, disk)
        return Dropped(len(shards), disk, ram, was_damaged=False)

    def _remember_dropped_locked(self, name: str) -> None:
        self._dropped[name] = time.time()
        self._dropped.move_to_end(name)
        while len(self._dropped) > DROPPED_REMEMBERED:
            self._dropped.popitem(last=False)
