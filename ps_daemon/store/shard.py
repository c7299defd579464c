"""One shard: its arena (master values, then optimizer state), its version and its
reader/writer hold. The store decides what happens to a shard; this file keeps its
invariants."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from ps_offload.daemon.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from ps_offload.daemon.model.optimizer import OptimizerConfig, ShardOptimizer, state_tensors
from ps_offload.daemon.store.accumulate import GradientParts
from ps_offload.daemon.store.pull_rounding import PULL_DTYPES
from ps_offload.daemon.store.pull_wait import PullWait
from ps_offload.daemon.tiers.tier import RAM_SUMS, SumStore, arena_tensor
from ps_offload.proto.plan import FP32_BYTES, ParamLayout, ShardSlice, segments_of

# Elements between the arena's tensors, so that master, m and v (and the staging buffer a
# gradient arrives in: ps_daemon/rpc/staging.py) start 1 KiB apart modulo 4 KiB. Shard sizes
# are whole 4 KiB pages, so without it the fused kernel's four streams hit the same page
# offset and their loads and stores alias (4K aliasing): measured 7% slower than
# torch.optim on separately allocated tensors, and level with it once staggered.
ARENA_STAGGER = 256


def arena_offsets(numel: int, state_numels: tuple[int, ...]) -> list[int]:
    """Where master (first) and each state tensor start in the arena, and where it ends."""
    offsets = [0]
    for size in (numel, *state_numels):
        offsets.append(offsets[-1] + size + ARENA_STAGGER)
    offsets[-1] -= ARENA_STAGGER  # (no stagger after the last)
    return offsets


def arena_numel(numel: int, state_tensors: int) -> int:
    """Elements of an arena whose `state_tensors` state tensors each hold one value per element."""
    return arena_offsets(numel, (numel,) * state_tensors)[-1]


def arena_nbytes(
    numel: int, optimizer: OptimizerConfig, state_dtype: str = "float32", state_numels: tuple[int, ...] | None = None
) -> int:
    """Bytes of one shard's arena: master, optimizer state and the stagger between them, in
    the model's state dtype. `state_numels`: the state tensors' sizes (default: one value per
    element each, ShardOptimizer.state_numels says otherwise for factored state)."""
    sizes = (numel,) * state_tensors(optimizer) if state_numels is None else state_numels
    return arena_offsets(numel, sizes)[-1] * PULL_DTYPES[state_dtype].itemsize


def allocate_arena(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A zeroed arena on page-aligned memory, and its whole-page view for O_DIRECT."""
    return arena_tensor(-(-nbytes // FP32_BYTES), nbytes)  # (a bf16 arena may end mid-word)


# The tensors a pull can stream (proto ShardTensor, in its order): the master values,
# then the optimizer state in the order the arena holds it (SGD's momentum buffer as exp_avg).
SHARD_TENSORS = ("master", "exp_avg", "exp_avg_sq")


class Shard:
    """One shard's master values, optimizer state and version.

    Invariants: `version` == number of gradient updates applied == optimizer.step;
    `master` and every optimizer state tensor have `slice.numel` elements of the model's
    state dtype (fp32, or bf16: ModelSpec.state_dtype); `version`,
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
        param_groups: tuple[int, ...] = (),
        sums: SumStore = RAM_SUMS,
        state_dtype: str = "float32",
    ):
        """`param_groups`: each parameter's param group, in layout order (empty: all 0).
        `sums`: where the sums of steps pushed in parts are made (ps_offload.daemon.store.accumulate).
        `state_dtype`: what master and state are kept in (ModelSpec.state_dtype)."""
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
        param_groups = param_groups or (0,) * len(layouts)
        self.optimizer = ShardOptimizer(
            optimizer,
            segments,
            decays,
            [param_groups[s.param_index] for s in segments],
            group_count=max(param_groups, default=0) + 1,
            state_dtype=PULL_DTYPES[state_dtype],
            shapes={s.param_index: layouts[s.param_index].shape for s in segments},
        )
        self.state_dtype = state_dtype
        self.arena_bytes = arena_nbytes(slice_.numel, optimizer, state_dtype, self.optimizer.state_numels())
        self.arena: torch.Tensor | None = None
        self.io_view: memoryview | None = None
        self.master: torch.Tensor | None = None
        # Tier state (ps_offload.daemon.tiers.ram, under its lock). Without an NVMe tier a shard is
        # resident from birth to death.
        self.resident = False
        self.loading = False
        self.pins = 0
        if not persistent:
            self.attach((torch.zeros(-(-self.arena_bytes // FP32_BYTES), dtype=torch.float32), None))
            self.resident = True
        self.version = 0
        self.initialized = False
        self.cond = threading.Condition()
        self.readers = 0
        self.writing = False
        self.writers_waiting = 0
        self.corrupt = ""  # why the shard's bytes on disk cannot be trusted; "" when fine
        self.rolled_back = False  # corrupt because its newest header is gone (tiers.version_floors)
        self.dropped = False  # its model was dropped (ModelRegistry.drop): every wait and hold ends NOT_FOUND
        # Data plane pulls parked for a version (min_version, wake), woken by notify_locked.
        self.watchers: list[tuple[int, Callable[[], None]]] = []
        # The step being pushed in parts (its own lock; in RAM even while the arena is not).
        self.parts = GradientParts(sums)

    def attach(self, buffer: tuple[torch.Tensor, memoryview | None]) -> None:
        """Places master and optimizer state in `buffer` (arena tensor, O_DIRECT view). The
        master values come first: a pull of a shard on NVMe reads only the arena's first pages
        (ps_offload.daemon.store.master_pull)."""
        self.arena, self.io_view = buffer
        sizes = (self.slice.numel, *self.optimizer.state_numels())
        offsets = arena_offsets(self.slice.numel, sizes[1:])
        typed = self.arena.view(self.master_dtype)  # (a tier may hand any dtype's buffer)
        views = [typed[start : start + size] for start, size in zip(offsets, sizes, strict=False)]
        self.master = views[0]
        self.optimizer.bind(views[1:])

    def check_tensor(self, name: str) -> None:
        """Raises unless `name` (one of SHARD_TENSORS) is a tensor this shard holds."""
        if name not in SHARD_TENSORS:
            raise InvalidArgument(f"unknown shard tensor {name!r}; one of {', '.join(SHARD_TENSORS)}")
        # The state tensors in arena order, served by position: AdamW's (and LAMB's) exp_avg and
        # exp_avg_sq; SGD's momentum buffer, served as exp_avg (SGD without momentum has none).
        plugin = self.optimizer.plugin
        if name != SHARD_TENSORS[0] and not plugin.per_element_state:
            raise FailedPrecondition(
                f"shard {self.slice.shard_id} of model {self.model!r} runs {plugin.name}, whose state is factored "
                f"(not one value per element): it serves only the master values, not {name}"
            )
        if SHARD_TENSORS.index(name) > state_tensors(self.optimizer.config):
            raise FailedPrecondition(
                f"shard {self.slice.shard_id} of model {self.model!r} runs {self.optimizer.plugin.name}, "
                f"which has no {name}"
            )

    @property
    def master_dtype(self) -> torch.dtype:
        """The torch dtype of master values and state (the arena's elements)."""
        return PULL_DTYPES[self.state_dtype]

    def tensor(self, name: str) -> torch.Tensor:
        """The master values or a state tensor (check_tensor first); resident only."""
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
    def resident_bytes(self) -> int:
        return self.arena_bytes if self.resident else 0

    def ready_locked(self, min_version: int) -> bool:
        return self.initialized and self.version >= min_version

    def await_version(
        self, min_version: int, timeout: float, waiting: PullWait | None = None, *, waited: float | None = None
    ) -> None:
        """Returns once the shard is initialized at min_version or later, without holding it.
        `waiting` (a gRPC pull's, ps_daemon/store/pull_wait.py): a wait needs its admission (else
        RESOURCE_EXHAUSTED) and ends early when its call ends. `waited`: how long the caller
        has waited already (a data plane pull parked until its deadline), for the message."""
        with self.cond:
            if self.ready_locked(min_version):
                return
            with waiting.parked(self.cond) if waiting is not None else contextlib.nullcontext():
                done = self.cond.wait_for(
                    lambda: self.ready_locked(min_version) or self.dropped or (waiting is not None and waiting.ended),
                    timeout,
                )
            self.check_not_dropped()
            if done and self.ready_locked(min_version):
                return
            if waiting is not None and waiting.ended:
                raise DeadlineExceeded(f"pull of shard {self.slice.shard_id} of model {self.model!r}: the caller left")
            raise self._not_there(min_version, timeout if waited is None else waited)

    def watch(self, min_version: int, wake: Callable[[], None]) -> bool:
        """Parks a wait for min_version without a thread: `wake()` is called once (under
        `cond`, from the committing thread: it must only hand the wait on) when the shard is
        there or dropped. False, and nothing parked, if it is either already."""
        with self.cond:
            if self.dropped or self.ready_locked(min_version):
                return False
            self.watchers.append((min_version, wake))
            return True

    def unwatch(self, wake: Callable[[], None]) -> None:
        with self.cond:
            self.watchers = [(v, w) for v, w in self.watchers if w is not wake]

    def notify_locked(self) -> None:
        """Under `cond`, after a change a wait may be for (a commit, a drop): wakes the threads
        waiting on it and the parked watchers that can go on."""
        self.cond.notify_all()
        if not self.watchers:
            return
        waking = [w for v, w in self.watchers if self.dropped or self.ready_locked(v)]
        if waking:
            self.watchers = [(v, w) for v, w in self.watchers if not (self.dropped or self.ready_locked(v))]
            for wake in waking:
                wake()

    def check_not_dropped(self) -> None:
        if self.dropped:
            raise NotFound(f"model {self.model!r} was dropped from this daemon (ps-admin drop); register it again")

    def _not_there(self, min_version: int, timeout: float) -> DeadlineExceeded:
        state = f"at version {self.version}" if self.initialized else "without initial values"
        return DeadlineExceeded(
            f"shard {self.slice.shard_id} of model {self.model!r} is still {state} after "
            f"{timeout:.1f}s; waited for version {min_version}. Is a trainer pushing it?"
        )

    @contextlib.contextmanager
    def reading(self, min_version: int, timeout: float, *, require_values: bool = True) -> Iterator[int]:
        """Holds the shard for reading once it is at min_version (and initialized, unless
        `require_values` is False); yields the version being read."""
        with self.cond:
            ready = self.cond.wait_for(
                lambda: (
                    self.dropped
                    or (
                        (self.initialized or not require_values)
                        and self.version >= min_version
                        and not self.writing
                        and not self.writers_waiting
                    )
                ),
                timeout=timeout,
            )
            self.check_not_dropped()
            if not ready:
                raise self._not_there(min_version, timeout)
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
            self.cond.wait_for(lambda: self.dropped or (not self.writing and self.readers == 0))
            self.writers_waiting -= 1
            self.check_not_dropped()
            self.writing = True
        try:
            yield
        finally:
            with self.cond:
                self.writing = False
                self.notify_locked()
