"""Shards held by one daemon: registration, pull, push with (shard, step) dedup, apply.

No gRPC here: the servicer translates protobuf to these calls and the typed errors in
ps_daemon.errors back to status codes.

Versions: a shard's version is the number of gradient updates applied to it. A gradient
push for `step` is applied only when step == version, then version becomes step + 1; a push
for step < version was applied before and is acknowledged without effect (so retries are
safe); a push for step > version is from the future and refused. Initial values are pushed
once, before the first update, and mark the shard `initialized`; pulls wait for that.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ps_offload.daemon.encodings import CompressedGradient, OneBitGradient, TopKGradient, check_size
from ps_offload.daemon.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StorageError,
)
from ps_offload.daemon.optim import AdamWConfig, OptimizerConfig, ShardOptimizer, validate_optimizer
from ps_offload.daemon.tiers.nvme import PAGE, CorruptShard, NoCapacity, NoFreeSlot, NvmeFiles, SlotCheck, arena_tensor
from ps_offload.daemon.tiers.ram import RamTier, TierFull
from ps_offload.proto.plan import (
    FP32_BYTES,
    ParamLayout,
    PlanError,
    ShardSlice,
    layout_params,
    plan_shards,
    segments_of,
    shard_numel_for,
)

log = logging.getLogger(__name__)

SUPPORTED_COMPUTE_DTYPES = ("float32",)
# Lock-free reads of a shard's committed slot before `verify` holds the shard still instead.
VERIFY_ATTEMPTS = 3


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    weight_decay: float | None = None


@dataclass(frozen=True)
class ModelSpec:
    """What RegisterModel declares. Two registrations are the same iff their `identity()`
    is: the daemon addresses may change (a daemon restarted on another port, a host name
    instead of an address) as long as there are as many, because the plan depends only on
    their number and order."""

    model: str
    params: tuple[ParamSpec, ...]
    optimizer: OptimizerConfig
    shard_bytes: int
    daemons: tuple[str, ...]

    def identity(self) -> tuple:
        return (self.model, self.params, self.optimizer, self.shard_bytes, len(self.daemons))


# Elements between the arena's tensors, so that master, m and v (and the staging buffer a
# gradient arrives in: ps_daemon/buffers.py) start 1 KiB apart modulo 4 KiB. Shard sizes
# are whole 4 KiB pages, so without it the fused kernel's four streams hit the same page
# offset and their loads and stores alias (4K aliasing): measured 7% slower than
# torch.optim on separately allocated tensors, and level with it once staggered.
ARENA_STAGGER = 256


def arena_numel(numel: int, state_tensors: int) -> int:
    return numel * (1 + state_tensors) + state_tensors * ARENA_STAGGER


def allocate_arena(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A zeroed arena on page-aligned memory, and its whole-page view for O_DIRECT."""
    return arena_tensor(nbytes // FP32_BYTES, nbytes)


# The fp32 tensors a pull can stream (proto ShardTensor, in its order): the master values,
# then AdamW's state in the order the arena holds it.
SHARD_TENSORS = ("master", "exp_avg", "exp_avg_sq")


class Shard:
    """One shard's master values, optimizer state and version.

    Invariants: `version` == number of gradient updates applied == optimizer.step;
    `master` and every optimizer state tensor have `slice.numel` fp32 elements; `version`,
    `initialized`, `readers` and `writing` change only under `cond`. Readers (pulls) share
    the shard; a writer (an update) has it alone, and waiting writers go first so that a
    stream of pulls cannot starve an update.
    """

    def __init__(
        self,
        model: str,
        slice_: ShardSlice,
        layouts: list[ParamLayout],
        optimizer: OptimizerConfig,
        *,
        persistent: bool,
    ):
        segments = segments_of(slice_, layouts)
        self.model = model
        self.slice = slice_
        self.param_names = tuple(layouts[s.param_index].name for s in segments)
        decays = [
            layouts[s.param_index].weight_decay
            if layouts[s.param_index].weight_decay is not None
            else optimizer.weight_decay
            for s in segments
        ]
        self.optimizer = ShardOptimizer(optimizer, segments, decays)
        self.arena_bytes = arena_numel(slice_.numel, optimizer.state_per_param) * FP32_BYTES
        self.arena: torch.Tensor | None = None
        self.io_view: memoryview | None = None
        self.master: torch.Tensor | None = None
        # Tier state (ps_daemon.tiers.ram, under its lock). Without an NVMe tier a shard is
        # resident from birth to death.
        self.resident = False
        self.loading = False
        self.pins = 0
        if not persistent:
            self.attach((torch.zeros(self.arena_bytes // FP32_BYTES, dtype=torch.float32), None))
            self.resident = True
        self.version = 0
        self.initialized = False
        self.cond = threading.Condition()
        self.readers = 0
        self.writing = False
        self.writers_waiting = 0
        self.corrupt = ""  # why the shard's bytes on disk cannot be trusted; "" when fine

    def attach(self, buffer: tuple[torch.Tensor, memoryview | None]) -> None:
        """Places master and optimizer state in `buffer` (arena tensor, O_DIRECT view)."""
        self.arena, self.io_view = buffer
        numel, step = self.slice.numel, self.slice.numel + ARENA_STAGGER
        views = [self.arena[i * step : i * step + numel] for i in range(1 + self.optimizer.config.state_per_param)]
        self.master = views[0]
        self.optimizer.bind(views[1:])

    def check_tensor(self, name: str) -> None:
        """Raises unless `name` (one of SHARD_TENSORS) is a tensor this shard holds."""
        if name not in SHARD_TENSORS:
            raise InvalidArgument(f"unknown shard tensor {name!r}; one of {', '.join(SHARD_TENSORS)}")
        if name != "master" and not isinstance(self.optimizer.config, AdamWConfig):
            raise FailedPrecondition(
                f"shard {self.slice.shard_id} of model {self.model!r} runs {type(self.optimizer.config).__name__}, "
                f"which has no {name}"
            )

    def tensor(self, name: str) -> torch.Tensor:
        """The master values or an AdamW state tensor (check_tensor first); resident only."""
        return self.master if name == "master" else self.optimizer.state[SHARD_TENSORS.index(name) - 1]

    def detach(self) -> tuple[torch.Tensor, memoryview | None] | None:
        """Gives the arena back (eviction); None if there was none."""
        if self.arena is None:
            return None
        buffer = (self.arena, self.io_view)
        self.arena = self.io_view = self.master = None
        self.optimizer.state = []
        return buffer

    @property
    def tier(self) -> str:
        if self.corrupt:
            return "corrupt"
        return "ram" if self.resident else "nvme"

    def set_version(self, version: int, *, initialized: bool) -> None:
        self.version = version
        self.initialized = initialized
        self.optimizer.step.fill_(version)

    @property
    def nbytes(self) -> int:
        return self.slice.numel * FP32_BYTES

    @property
    def resident_bytes(self) -> int:
        return self.arena_bytes if self.resident else 0

    @contextlib.contextmanager
    def reading(self, min_version: int, timeout: float, *, require_values: bool = True) -> Iterator[int]:
        """Holds the shard for reading once it is at min_version (and initialized, unless
        `require_values` is False); yields the version being read."""
        with self.cond:
            ready = self.cond.wait_for(
                lambda: (
                    (self.initialized or not require_values)
                    and self.version >= min_version
                    and not self.writing
                    and not self.writers_waiting
                ),
                timeout=timeout,
            )
            if not ready:
                state = f"at version {self.version}" if self.initialized else "without initial values"
                raise DeadlineExceeded(
                    f"shard {self.slice.shard_id} of model {self.model!r} is still {state} after "
                    f"{timeout:.1f}s; waited for version {min_version}. Is a trainer pushing it?"
                )
            self.readers += 1
            version = self.version
        try:
            yield version
        finally:
            with self.cond:
                self.readers -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def writing_lock(self) -> Iterator[None]:
        with self.cond:
            self.writers_waiting += 1
            self.cond.wait_for(lambda: not self.writing and self.readers == 0)
            self.writers_waiting -= 1
            self.writing = True
        try:
            yield
        finally:
            with self.cond:
                self.writing = False
                self.cond.notify_all()


@dataclass
class StoreStats:
    bytes_pulled: int = 0
    bytes_pushed: int = 0
    pulls: int = 0
    pushes_applied: int = 0
    pushes_duplicate: int = 0
    optimizer_seconds: float = 0.0
    prefetch_hints: int = 0
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class ValueStats:
    norm: float
    min: float
    max: float
    nan_count: int
    # Finite values counted in equal bins over [histogram_low, histogram_high] (their
    # smallest and largest); empty unless asked for.
    histogram: tuple[int, ...] = ()
    histogram_low: float = 0.0
    histogram_high: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """What `ShardStore.verify` found for one shard."""

    model: str
    shard_id: int
    status: str  # "ok", "bad" or "not_at_rest"
    detail: str  # why, when "bad"; what was checked otherwise
    version: int
    bytes_read: int
    tier: str
    nonfinite: int = 0  # RAM only: NaN or infinite master values in memory


@dataclass(frozen=True)
class StatsSnapshot:
    models: int
    shards: int
    ram_bytes_used: int
    bytes_pulled: int
    bytes_pushed: int
    pulls: int
    pushes_applied: int
    pushes_duplicate: int
    optimizer_seconds: float
    prefetch_hints: int
    uptime_seconds: float
    tier_hits: int
    tier_misses: int
    prefetched: int
    evictions: int
    nvme_bytes_read: int
    nvme_bytes_written: int
    nvme_read_seconds: float
    nvme_write_seconds: float
    ram_bytes_budget: int
    nvme_bytes_allocated: int
    nvme_bytes_capacity: int
    shards_in_ram: int
    shards_on_nvme: int
    shards_corrupt: int


@dataclass
class RegisteredModel:
    spec: ModelSpec
    daemon_index: int
    layouts: list[ParamLayout]
    plan: list[ShardSlice]
    shards: dict[int, Shard]  # only the shards this daemon owns


@dataclass(frozen=True)
class PushResult:
    applied: bool
    version: int


class ShardStore:
    def __init__(
        self, *, ram_bytes: int, default_shard_bytes: int, files: NvmeFiles | None = None, prefetch_depth: int = 2
    ) -> None:
        self.ram_bytes = ram_bytes
        self.files = files  # None: RAM only, nothing survives a restart
        self.tier = (
            RamTier(budget=ram_bytes, allocate=allocate_arena, load=self._load_into) if files is not None else None
        )
        # Per model: the order in which the previous step pushed its shards, and this step's
        # so far; the next shards in that order are prefetched as each push arrives.
        self._orders: dict[str, tuple[int, list[int], list[int]]] = {}
        self.prefetch_depth = prefetch_depth
        self.default_shard_bytes = default_shard_bytes
        self.stats = StoreStats()
        # Called with each shard's optimizer time, outside the store's locks (metrics).
        self.on_optimizer_step: Callable[[float], None] | None = None
        self._models: dict[str, RegisteredModel] = {}
        self._lock = threading.Lock()  # guards _models and stats counters

    # -- registration -------------------------------------------------------------------

    def resolve_shard_bytes(self, spec: ModelSpec) -> ModelSpec:
        """A spec with shard_bytes 0 asks for this daemon's default."""
        if spec.shard_bytes:
            return spec
        return ModelSpec(spec.model, spec.params, spec.optimizer, self.default_shard_bytes, spec.daemons)

    def register(self, spec: ModelSpec, daemon_index: int) -> tuple[RegisteredModel, bool]:
        """Creates the model's shards owned by `daemon_index`; returns (model, created)."""
        spec = self.resolve_shard_bytes(spec)
        _validate_spec(spec, daemon_index)
        with self._lock:
            existing = self._models.get(spec.model)
            if existing is not None:
                if existing.spec.identity() != spec.identity() or existing.daemon_index != daemon_index:
                    raise FailedPrecondition(
                        f"model {spec.model!r} is already registered with a different spec "
                        f"({_spec_difference(existing.spec, spec, existing.daemon_index, daemon_index)}); "
                        "register it under a new name, or restart the daemon to drop it"
                    )
                existing.spec = spec  # same identity; the addresses may be new
                return existing, False
            registered = self._build(spec, daemon_index)
            self._check_ram(spec.model, registered)
            if self.files is not None:
                self._create_files(spec, daemon_index, registered)
            self._models[spec.model] = registered
            return registered, True

    def _create_files(self, spec: ModelSpec, daemon_index: int, model: RegisteredModel) -> None:
        arena_bytes = {sid: shard.arena_bytes for sid, shard in model.shards.items()}
        where = f"model {spec.model!r} on this daemon"
        try:
            self.files.create_model(spec, daemon_index, arena_bytes)
        except NoCapacity as exc:
            raise ResourceExhausted(f"{where}: {exc}. Raise store.nvme_bytes or add daemons") from exc
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                layout = self.files.layout_for(arena_bytes)
                raise ResourceExhausted(
                    f"{where}: nvme_dir {self.files.dir} has no room for its {layout.size} bytes "
                    f"({layout.slots} slots of {layout.slot_bytes}); free space or add daemons"
                ) from exc
            raise StorageError(f"{where}: cannot create its files: {exc}") from exc

    def _check_ram(self, name: str, model: RegisteredModel) -> None:
        """RAM only: every shard must fit. With an NVMe tier: the largest shard must (the
        rest waits on disk)."""
        arenas = [s.arena_bytes for s in model.shards.values()]
        if not arenas:
            return
        if self.tier is not None:
            if max(arenas) > self.ram_bytes:
                raise ResourceExhausted(
                    f"model {name!r} has shards of {max(arenas)} bytes in RAM (master and optimizer state), "
                    f"more than the RAM tier's {self.ram_bytes}. Raise store.ram_bytes or use smaller shards"
                )
            return
        need = sum(s.resident_bytes for s in model.shards.values())
        used = self._resident_bytes_locked()  # the new model is not in _models yet
        if used + need > self.ram_bytes:
            raise ResourceExhausted(
                f"model {name!r} needs {need} bytes on this daemon (master and optimizer "
                f"state); the RAM tier has {self.ram_bytes - used} of {self.ram_bytes} free. "
                "Raise store.ram_bytes, set store.nvme_dir, or add daemons"
            )

    def _build(self, spec: ModelSpec, daemon_index: int) -> RegisteredModel:
        layouts = layout_params([(p.name, p.shape, p.weight_decay) for p in spec.params])
        total = sum(p.numel for p in layouts)
        plan = plan_shards(total, shard_numel_for(spec.shard_bytes), len(spec.daemons))
        persistent = self.files is not None
        shards = {
            s.shard_id: Shard(spec.model, s, layouts, spec.optimizer, persistent=persistent)
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
        for spec, daemon_index, layout in self.files.recorded_models():
            model = self._build(spec, daemon_index)
            # Headers only: a model may be larger than RAM. The bytes are read, and their
            # checksum verified, when the shard is first used.
            headers = self.files.open_model(spec, layout, set(model.shards))
            for shard_id, shard in model.shards.items():
                header = headers.get(shard_id)
                if header is not None:
                    shard.set_version(header.version, initialized=header.initialized)
                recovered += 1
            with self._lock:
                self._models[spec.model] = model
        return recovered

    def _load_into(self, shard: Shard, buffer: tuple[torch.Tensor, memoryview]) -> None:
        """The RAM tier's loader: attaches `buffer` and reads the committed version into it."""
        shard.attach(buffer)
        try:
            self._load(shard)
        except BaseException:
            shard.detach()
            raise

    def _load(self, shard: Shard) -> None:
        """Sets the shard to its last committed version on disk (zeros if none). Raises
        DataLoss, and marks the shard, when those bytes fail their checksum."""
        try:
            header = self.files.load(shard.model, shard.slice.shard_id, shard.io_view)
        except CorruptShard as exc:
            shard.corrupt = (
                f"shard {shard.slice.shard_id} of model {shard.model!r} is corrupt on disk ({exc}); "
                "restore it from a checkpoint or re-register the model"
            )
            log.error("%s", shard.corrupt)
            raise DataLoss(shard.corrupt) from exc
        if header is None:
            shard.arena.zero_()
            shard.set_version(0, initialized=False)
        else:
            shard.set_version(header.version, initialized=header.initialized)

    def _commit(self, shard: Shard) -> None:
        """Persists the shard's new version before it is acknowledged. On a write error the
        shard goes back to its last committed version and the push fails."""
        if self.files is None:
            return
        try:
            self.files.commit(
                shard.model,
                shard.slice.shard_id,
                shard.io_view,
                version=shard.version,
                initialized=shard.initialized,
                numel=shard.slice.numel,
            )
        except NoFreeSlot as exc:
            self._load(shard)
            raise StorageError(
                f"shard {shard.slice.shard_id} of model {shard.model!r}: {exc} (failed writes take slots "
                f"out of use until restart); the update was not applied, the shard keeps version {shard.version}"
            ) from exc
        except OSError as exc:
            self._load(shard)  # back to the last committed version
            where = f"shard {shard.slice.shard_id} of model {shard.model!r}"
            if exc.errno == errno.ENOSPC:
                raise ResourceExhausted(
                    f"{where}: nvme_dir is full; the update was not applied and the shard keeps "
                    f"version {shard.version}. Free space, then retry the push"
                ) from exc
            raise StorageError(
                f"{where}: writing the update failed ({exc}); it was not applied and the shard "
                f"keeps version {shard.version}"
            ) from exc

    def _resident_bytes_locked(self) -> int:
        """RAM held by shards: resident arenas, plus the tier's pooled buffers."""
        if self.tier is not None:
            return self.tier.used + self.tier.pooled
        return sum(s.resident_bytes for m in self._models.values() for s in m.shards.values())

    # -- lookup -------------------------------------------------------------------------

    def model(self, name: str) -> RegisteredModel:
        model = self._models.get(name)
        if model is None:
            known = ", ".join(sorted(self._models)) or "none"
            raise NotFound(f"model {name!r} is not registered on this daemon (registered: {known})")
        return model

    def shard(self, model_name: str, shard_id: int) -> Shard:
        shard = self._find(model_name, shard_id)
        if shard.corrupt:
            raise DataLoss(shard.corrupt)
        return shard

    def _find(self, model_name: str, shard_id: int) -> Shard:
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
        return shard

    def models(self) -> list[RegisteredModel]:
        with self._lock:
            return list(self._models.values())

    # -- data path ----------------------------------------------------------------------

    @contextlib.contextmanager
    def pull(
        self, model: str, shard_id: int, *, min_version: int, timeout: float, tensor: str = "master"
    ) -> Iterator[tuple[torch.Tensor, int]]:
        """Holds the shard for reading at min_version or later: yields (its `tensor`, version),
        the tensor one of SHARD_TENSORS. The caller streams the tensor inside the block."""
        shard = self.shard(model, shard_id)
        shard.check_tensor(tensor)
        with self._using(shard), shard.reading(min_version, timeout) as version:
            yield shard.tensor(tensor), version
        with self._lock:
            self.stats.pulls += 1
            self.stats.bytes_pulled += shard.nbytes

    def check_push(
        self,
        model: str,
        shard_id: int,
        *,
        step: int,
        kind: str,
        nbytes: int,
        dtype: str,
        encoding: str = "raw",
        variance_frozen_at: int | None = None,
    ) -> PushResult | None:
        """Validates a push header before its payload is read. Returns the acknowledgement
        for a push that was applied before (no payload needed), else None."""
        shard = self.shard(model, shard_id)
        where = f"push to shard {shard_id}"
        if dtype != "float32":
            raise InvalidArgument(
                f"{where}: dtype {dtype} is not accepted; send float32 (a gradient may travel as "
                "bf16 or fp16 with encoding BF16 or FP16)"
            )
        if kind == "parameters" and encoding != "raw":
            raise InvalidArgument(
                f"{where}: initial PARAMETERS must be RAW float32 (they are the master values), "
                f"got encoding {encoding.upper()}; only gradients may be compressed"
            )
        _check_momentum(shard, where, step=step, kind=kind, variance_frozen_at=variance_frozen_at)
        check_size(encoding, nbytes, shard.slice.numel, where)
        with shard.cond:
            return self._check_step_locked(shard, step, kind)

    def _check_step_locked(self, shard: Shard, step: int, kind: str) -> PushResult | None:
        sid = shard.slice.shard_id
        if kind == "parameters":
            if shard.version > 0:
                raise FailedPrecondition(
                    f"shard {sid} has had {shard.version} updates; initial values can only be "
                    "pushed before the first update"
                )
            return None
        if not shard.initialized:
            raise FailedPrecondition(f"shard {sid} has no values yet: push its initial parameters before gradients")
        if step < shard.version:
            return PushResult(applied=False, version=shard.version)
        if step > shard.version:
            raise FailedPrecondition(
                f"push for step {step} to shard {sid}, which is at version {shard.version}: "
                f"step {shard.version} must be applied first"
            )
        return None

    def push(
        self,
        model: str,
        shard_id: int,
        *,
        step: int,
        kind: str,
        data: torch.Tensor | CompressedGradient,
        lr: float | None,
        scratch: Callable[[int], contextlib.AbstractContextManager[torch.Tensor]] | None = None,
        variance_frozen_at: int | None = None,
    ) -> PushResult:
        """Applies a gradient or a momentum (1-bit Adam), or writes initial values, held in
        `data`: fp32 with the shard's numel, or compressed (ps_daemon.encodings). Compressed
        values that the optimizer does not take as they are (all but a ONEBIT momentum) are
        first decompressed into an fp32 buffer from `scratch(numel)` (a StagingPool's borrow;
        a fresh tensor if None)."""
        shard = self.shard(model, shard_id)
        numel = shard.slice.numel
        compressed = not isinstance(data, torch.Tensor)
        if compressed:
            if data.numel != numel:
                raise InvalidArgument(f"push to shard {shard_id}: got {data.numel} elements, expected {numel}")
        elif data.dtype != torch.float32 or data.numel() != numel:
            raise InvalidArgument(
                f"push to shard {shard_id}: got {data.numel()} {data.dtype}, expected {numel} float32"
            )
        if compressed and kind == "parameters":
            raise InvalidArgument(f"push to shard {shard_id}: initial parameters must be RAW float32")
        _check_momentum(shard, f"push to shard {shard_id}", step=step, kind=kind, variance_frozen_at=variance_frozen_at)
        payload_bytes = _payload_bytes(data)
        fused = kind == "momentum" and isinstance(data, OneBitGradient)
        with contextlib.ExitStack() as held:
            if compressed and not fused:
                # Outside the shard's lock: the payload and the buffer are this push's own.
                out = held.enter_context(scratch(numel)) if scratch else torch.empty(numel, dtype=torch.float32)
                data = data.decompress(out[:numel])
            if kind != "parameters":
                self._learn_order(shard, step)
            with self._using(shard), shard.writing_lock():
                # Re-checked under the lock: a retry may have raced the first attempt.
                ack = self._check_step_locked(shard, step, kind)
                if ack is not None:
                    with self._lock:
                        self.stats.pushes_duplicate += 1
                    return ack
                if kind == "parameters":
                    shard.master.copy_(data)
                    shard.initialized = True
                    self._commit(shard)
                else:
                    started = time.perf_counter()
                    lr = shard.optimizer.config.lr if lr is None else lr
                    if kind == "momentum":
                        shard.optimizer.apply_momentum(shard.master, data, lr, variance_frozen_at)
                    else:
                        shard.optimizer.apply(shard.master, data, lr)
                    elapsed = time.perf_counter() - started
                    shard.version += 1
                    self._commit(shard)
                    with self._lock:
                        self.stats.optimizer_seconds += elapsed
                        self.stats.pushes_applied += 1
                    if self.on_optimizer_step is not None:
                        self.on_optimizer_step(elapsed)
                with self._lock:
                    self.stats.bytes_pushed += payload_bytes
                return PushResult(applied=True, version=shard.version)

    def note_duplicate(self) -> None:
        with self._lock:
            self.stats.pushes_duplicate += 1

    def prefetch(self, model: str, shard_ids: list[int]) -> int:
        """A trainer's hint: these shards next, in this order. Queued for loading into the
        RAM tier (bounded by its free room); returns how many were queued."""
        shards = [self.shard(model, shard_id) for shard_id in shard_ids]
        with self._lock:
            self.stats.prefetch_hints += len(shard_ids)
        return self.tier.prefetch(shards) if self.tier is not None else 0

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

    def _learn_order(self, shard: Shard, step: int) -> None:
        """Records the push order of each step; prefetches what came next last step."""
        if self.tier is None or not self.prefetch_depth:
            return
        with self._lock:
            current_step, previous, current = self._orders.get(shard.model, (step, [], []))
            if step != current_step:
                previous, current = current, []
            current.append(shard.slice.shard_id)
            self._orders[shard.model] = (step, previous, current)
            if shard.slice.shard_id not in previous:
                return
            at = previous.index(shard.slice.shard_id)
            upcoming = previous[at + 1 :]
        model = self._models[shard.model]
        self.tier.prefetch([model.shards[i] for i in upcoming if i in model.shards], limit=self.prefetch_depth)

    def value_stats(self, shard: Shard, *, timeout: float = 10.0, bins: int = 0) -> ValueStats:
        """Norm, min, max and NaN count of the master values, and a histogram of `bins`
        bins (0: none), under a read hold (pulls go on; an update waits until the statistics
        are done)."""
        with self._using(shard), shard.reading(0, timeout, require_values=False):
            values = shard.master
            finite = values[~torch.isnan(values)]
            return ValueStats(
                norm=float(torch.linalg.vector_norm(values)),
                min=float(finite.min()) if finite.numel() else float("nan"),
                max=float(finite.max()) if finite.numel() else float("nan"),
                nan_count=int(values.numel() - finite.numel()),
                **(_histogram(values, bins) if bins else {}),
            )

    # -- verify (ps-admin verify) -------------------------------------------------------

    def shards_to_verify(self, model: str = "") -> list[Shard]:
        """The named model's shards (NotFound if unknown), or every model's (""), in name and
        id order."""
        models = [self.model(model)] if model else sorted(self.models(), key=lambda m: m.spec.model)
        return [m.shards[i] for m in models for i in sorted(m.shards)]

    def verify_bytes(self, shards: list[Shard]) -> int:
        """About the bytes `verify` reads from disk for these shards (0 without NVMe)."""
        if self.files is None:
            return 0
        found = [self.files.committed_slot(s.model, s.slice.shard_id) for s in shards]
        return sum(PAGE + header.arena_bytes for _, header in filter(None, found))

    def verify(self, shards: list[Shard], *, hold_timeout: float = 60.0) -> Iterator[Verdict]:
        """Checks each shard, one at a time, as it is asked for. With an NVMe tier: reads its
        committed slot back (header and bytes) and checks the crc32c, bypassing the RAM tier
        (nothing is loaded, evicted or marked; a bad copy on disk is reported, not acted on).
        Without one there is nothing at rest: the shard is checked in memory only.

        Training goes on meanwhile. The slot is read without a lock; a commit of the shard
        during the read may free that slot for another commit to overwrite, so the read
        counts only if the same commit is still the shard's newest afterwards (else it is
        repeated on the new slot). After VERIFY_ATTEMPTS such misses the shard is held for
        reading, as a pull holds it, which keeps its next commit waiting for one read."""
        if self.files is None:
            for shard in shards:
                yield self._check_in_memory(shard, hold_timeout)
            return
        _, buffer = self.files.check_buffer()
        for shard in shards:
            yield self._check_at_rest(shard, buffer, hold_timeout)

    def _check_at_rest(self, shard: Shard, buffer: memoryview, hold_timeout: float) -> Verdict:
        model, shard_id = shard.model, shard.slice.shard_id
        for _ in range(VERIFY_ATTEMPTS):
            found = self.files.committed_slot(model, shard_id)
            if found is None:
                break
            check = self.files.check_slot(model, *found, buffer)
            if self.files.committed_slot(model, shard_id) is found:
                return self._at_rest_verdict(shard, check)
        else:
            try:
                with shard.reading(0, hold_timeout, require_values=False):
                    found = self.files.committed_slot(model, shard_id)
                    if found is not None:
                        return self._at_rest_verdict(shard, self.files.check_slot(model, *found, buffer))
            except DeadlineExceeded as exc:
                raise DeadlineExceeded(
                    f"verify: shard {shard_id} of model {model!r} was committed anew during every read and "
                    f"then could not be held still for {hold_timeout:.0f}s; try again"
                ) from exc
        detail = "nothing committed yet: its initial values were never pushed"
        return Verdict(model, shard_id, "not_at_rest", detail, shard.version, 0, shard.tier)

    @staticmethod
    def _at_rest_verdict(shard: Shard, check: SlotCheck) -> Verdict:
        model, shard_id, tier = shard.model, shard.slice.shard_id, shard.tier
        if check.problem:
            detail = check.problem
            if tier == "ram":
                detail += (
                    "; the shard is resident, so its next update writes a good copy (evicted before that, "
                    "it would be refused with DATA_LOSS)"
                )
            return Verdict(model, shard_id, "bad", detail, check.version, check.bytes_read, tier)
        if shard.corrupt:  # failed its checksum on an earlier read; refused until a restart
            detail = f"{shard.corrupt} (slot {check.slot} reads back intact now; restart the daemon to use it)"
            return Verdict(model, shard_id, "bad", detail, check.version, check.bytes_read, tier)
        detail = f"version {check.version} in slot {check.slot} matches its crc32c"
        return Verdict(model, shard_id, "ok", detail, check.version, check.bytes_read, tier)

    @staticmethod
    def _check_in_memory(shard: Shard, hold_timeout: float) -> Verdict:
        """RAM only: the in-memory invariants and the values, under a read hold."""
        model, shard_id = shard.model, shard.slice.shard_id
        with shard.reading(0, hold_timeout, require_values=False):
            version, steps = shard.version, shard.optimizer.step.item()
            nonfinite = int(shard.master.numel() - torch.isfinite(shard.master).sum())
        if steps != torch.tensor(version, dtype=torch.float32).item():  # the step count is fp32, as torch's
            detail = f"in memory at version {version}, but its optimizer has taken {steps:.0f} steps"
            return Verdict(model, shard_id, "bad", detail, version, 0, shard.tier, nonfinite)
        values = f"{nonfinite} non-finite master values" if shard.initialized else "no values pushed yet"
        detail = f"RAM only (no store.nvme_dir): nothing at rest to checksum; in memory: {values}"
        return Verdict(model, shard_id, "not_at_rest", detail, version, 0, shard.tier, nonfinite)

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()

    def stats_snapshot(self) -> StatsSnapshot:
        with self._lock:
            s = self.stats
            return StatsSnapshot(
                models=len(self._models),
                shards=sum(len(m.shards) for m in self._models.values()),
                ram_bytes_used=self._resident_bytes_locked(),
                bytes_pulled=s.bytes_pulled,
                bytes_pushed=s.bytes_pushed,
                pulls=s.pulls,
                pushes_applied=s.pushes_applied,
                pushes_duplicate=s.pushes_duplicate,
                optimizer_seconds=s.optimizer_seconds,
                prefetch_hints=s.prefetch_hints,
                uptime_seconds=time.monotonic() - s.started,
                **self._tier_counts(),
            )

    def _tier_counts(self) -> dict[str, int | float]:
        """The tier fields of StatsSnapshot (called under self._lock)."""
        tiers = [shard.tier for model in self._models.values() for shard in model.shards.values()]
        files = self.files
        counts = dict(
            ram_bytes_budget=self.ram_bytes,
            shards_in_ram=tiers.count("ram"),
            shards_on_nvme=tiers.count("nvme"),
            shards_corrupt=tiers.count("corrupt"),
            nvme_bytes_allocated=files.bytes_allocated if files is not None else 0,
            nvme_bytes_capacity=files.capacity if files is not None else 0,
            nvme_bytes_read=files.bytes_read if files is not None else 0,
            nvme_bytes_written=files.bytes_written if files is not None else 0,
            nvme_read_seconds=files.read_seconds if files is not None else 0.0,
            nvme_write_seconds=files.write_seconds if files is not None else 0.0,
        )
        if self.tier is None:
            return {**counts, "tier_hits": 0, "tier_misses": 0, "prefetched": 0, "evictions": 0}
        with self.tier.cond:
            t = self.tier.stats
            return {**counts, "tier_hits": t.hits, "tier_misses": t.misses, "prefetched": t.prefetched,
                    "evictions": t.evictions}  # fmt: skip


def _histogram(values: torch.Tensor, bins: int) -> dict:
    """ValueStats' histogram fields: the finite values in `bins` equal bins between their
    smallest and largest (one bin when those are equal)."""
    finite = values[torch.isfinite(values)]
    if not finite.numel():
        return {}
    low, high = float(finite.min()), float(finite.max())
    if low == high:
        return dict(histogram=(finite.numel(),), histogram_low=low, histogram_high=high)
    counts = torch.histc(finite.double(), bins=bins, min=low, max=high)  # float64: exact counts
    return dict(histogram=tuple(int(c) for c in counts), histogram_low=low, histogram_high=high)


@contextlib.contextmanager
def _tier_errors(use):
    try:
        with use:
            yield
    except TierFull as exc:
        raise ResourceExhausted(str(exc)) from exc


def _check_momentum(shard: Shard, where: str, *, step: int, kind: str, variance_frozen_at: int | None) -> None:
    """A MOMENTUM push needs an AdamW shard and a variance frozen after 1..step updates;
    variance_frozen_at belongs to MOMENTUM pushes only."""
    if kind != "momentum":
        if variance_frozen_at is not None:
            raise InvalidArgument(f"{where}: variance_frozen_at is for MOMENTUM pushes only, this is {kind.upper()}")
        return
    if not isinstance(shard.optimizer.config, AdamWConfig):
        raise FailedPrecondition(
            f"{where}: MOMENTUM pushes are 1-bit Adam's compression stage and need an AdamW model; "
            f"model {shard.model!r} runs {type(shard.optimizer.config).__name__} (push gradients instead)"
        )
    if variance_frozen_at is None or not 1 <= variance_frozen_at <= step:
        raise InvalidArgument(
            f"{where}: a MOMENTUM push for step {step} needs variance_frozen_at in [1, {step}] (the uncompressed "
            f"warm-up steps after which exp_avg_sq stopped), got {variance_frozen_at}"
        )


def _payload_bytes(data: torch.Tensor | CompressedGradient) -> int:
    """Bytes the push carried on the wire."""
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    if isinstance(data, OneBitGradient):
        return data.scales.numel() * 4 + data.bits.numel()
    if isinstance(data, TopKGradient):
        return 4 + 8 * data.indices.numel()
    return data.values.numel() * data.values.element_size()


def shard_resident_bytes(numel: int, optimizer: OptimizerConfig) -> int:
    """Bytes one shard holds in RAM: master, optimizer state and the stagger between them."""
    return arena_numel(numel, optimizer.state_per_param) * FP32_BYTES


def _validate_spec(spec: ModelSpec, daemon_index: int) -> None:
    if not spec.model:
        raise InvalidArgument("the model name is empty")
    if not spec.params:
        raise InvalidArgument(f"model {spec.model!r} has no parameters")
    if not spec.daemons:
        raise InvalidArgument("the daemon list is empty")
    if not 0 <= daemon_index < len(spec.daemons):
        raise InvalidArgument(f"daemon_index {daemon_index} is outside the daemon list of {len(spec.daemons)}")
    for param in spec.params:
        if param.dtype not in SUPPORTED_COMPUTE_DTYPES:
            raise InvalidArgument(
                f"parameter {param.name!r}: compute dtype {param.dtype} is not supported yet "
                f"(supported: {', '.join(SUPPORTED_COMPUTE_DTYPES)})"
            )
        if param.weight_decay is not None and not param.weight_decay >= 0:
            raise InvalidArgument(f"parameter {param.name!r}: weight_decay must be >= 0")
    try:
        validate_optimizer(spec.optimizer)
        shard_numel_for(spec.shard_bytes)
        layout_params([(p.name, p.shape, p.weight_decay) for p in spec.params])
    except (ValueError, PlanError) as exc:
        raise InvalidArgument(f"model {spec.model!r}: {exc}") from exc


def _spec_difference(old: ModelSpec, new: ModelSpec, old_index: int, new_index: int) -> str:
    if old_index != new_index:
        return f"this daemon is index {old_index}, the new request says {new_index}"
    if len(old.daemons) != len(new.daemons):
        return f"{len(old.daemons)} daemons before, {len(new.daemons)} now"
    for name in ("params", "optimizer", "shard_bytes"):
        if getattr(old, name) != getattr(new, name):
            if name == "params":
                for a, b in zip(old.params, new.params, strict=False):  # lengths may differ
                    if a != b:
                        return f"parameter {a.name!r} was {a}, now {b}"
                return f"{len(old.params)} parameters before, {len(new.params)} now"
            return f"{name} was {getattr(old, name)}, now {getattr(new, name)}"
    return "unknown difference"
