"""Admin inspection of shards, without changing them: value statistics (ps-admin shard) and
verify (the committed bytes against their crc32c, or the in-memory invariants without an
NVMe tier). The store's counters (ps-admin stats) are ps_offload.daemon.store.stats'."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ps_offload.daemon.errors import DeadlineExceeded
from ps_offload.daemon.store.shard import Shard
from ps_offload.daemon.store.shard_store import ShardStore
from ps_offload.daemon.tiers.tier import PAGE, ShardFiles, SlotCheck

# Lock-free reads of a shard's committed slot before `verify` holds the shard still instead.
VERIFY_ATTEMPTS = 3


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
    """What `verify` found for one shard."""

    model: str
    shard_id: int
    status: str  # "ok", "bad" or "not_at_rest"
    detail: str  # why, when "bad"; what was checked otherwise
    version: int
    bytes_read: int
    tier: str
    nonfinite: int = 0  # RAM only: NaN or infinite master values in memory


def value_stats(store: ShardStore, shard: Shard, *, timeout: float = 10.0, bins: int = 0) -> ValueStats:
    """Norm, min, max and NaN count of the shard's master values, and a histogram of `bins`
    bins (0: none): the shard brought into RAM for the while, under a read hold (pulls go
    on; an update waits until the statistics are done)."""
    with store.tier.use(shard), shard.reading(0, timeout, require_values=False):
        values = shard.master.float()  # (norms of bf16 state in fp32)
        finite = values[~torch.isnan(values)]
        return ValueStats(
            norm=float(torch.linalg.vector_norm(values)),
            min=float(finite.min()) if finite.numel() else float("nan"),
            max=float(finite.max()) if finite.numel() else float("nan"),
            nan_count=int(values.numel() - finite.numel()),
            **(_histogram(values, bins) if bins else {}),
        )


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


# -- verify (ps-admin verify) -----------------------------------------------------------


def shards_to_verify(store: ShardStore, model: str = "") -> list[Shard]:
    """The named model's shards (NotFound if unknown), or every model's (""), in name and
    id order."""
    models = [store.registry.model(model)] if model else sorted(store.registry.models(), key=lambda m: m.spec.model)
    return [m.shards[i] for m in models for i in sorted(m.shards)]


def damaged_models(store: ShardStore, model: str = "") -> dict[str, str]:
    """The models (the named one, or every one: "") that are bad as a whole: not recovered at
    start, or not coming back at the next one (ShardFiles.restart_problem) -> why."""
    names = [model] if model else sorted({*(m.spec.model for m in store.registry.models()), *store.registry.damaged})
    damaged = {}
    for name in names:
        why = store.registry.damaged.get(name) or store.files.restart_problem(name)
        if why:
            damaged[name] = why
    return damaged


def verify_bytes(files: ShardFiles, shards: list[Shard]) -> int:
    """About the bytes `verify` reads from disk for these shards (0 without NVMe: nothing is
    committed there)."""
    found = [files.committed_slot(s.model, s.slice.shard_id) for s in shards]
    return sum(PAGE + header.arena_bytes for _, header in filter(None, found))


def verify(files: ShardFiles, shards: list[Shard], *, hold_timeout: float = 60.0) -> Iterator[Verdict]:
    """Checks each shard, one at a time, as it is asked for. With an NVMe tier: reads its
    committed slot back (header and bytes) and checks the crc32c, bypassing the RAM tier
    (nothing is loaded, evicted or marked; a bad copy on disk is reported, not acted on).
    Without one there is nothing at rest: the shard is checked in memory only.

    Training goes on meanwhile. The slot is read without a lock; a commit of the shard
    during the read may free that slot for another commit to overwrite, so the read
    counts only if the same commit is still the shard's newest afterwards (else it is
    repeated on the new slot). After VERIFY_ATTEMPTS such misses the shard is held for
    reading, as a pull holds it, which keeps its next commit waiting for one read."""
    if not files.at_rest:
        for shard in shards:
            yield _check_in_memory(shard, hold_timeout)
        return
    _, buffer = files.check_buffer()
    for shard in shards:
        yield _check_at_rest(files, shard, buffer, hold_timeout)


def _check_at_rest(files: ShardFiles, shard: Shard, buffer: memoryview, hold_timeout: float) -> Verdict:
    model, shard_id = shard.model, shard.slice.shard_id
    for _ in range(VERIFY_ATTEMPTS):
        found = files.committed_slot(model, shard_id)
        if found is None:
            break
        check = files.check_slot(model, *found, buffer)
        if files.committed_slot(model, shard_id) is found:
            return _at_rest_verdict(shard, check)
    else:
        try:
            with shard.reading(0, hold_timeout, require_values=False):
                found = files.committed_slot(model, shard_id)
                if found is not None:
                    return _at_rest_verdict(shard, files.check_slot(model, *found, buffer))
        except DeadlineExceeded as exc:
            raise DeadlineExceeded(
                f"verify: shard {shard_id} of model {model!r} was committed anew during every read and "
                f"then could not be held still for {hold_timeout:.0f}s; try again"
            ) from exc
    detail = "nothing committed yet: its initial values were never pushed"
    return Verdict(model, shard_id, "not_at_rest", detail, shard.version, 0, shard.tier)


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
    if shard.rolled_back:  # the slot read is an older version's: the newest one's header is gone
        return Verdict(model, shard_id, "bad", shard.corrupt, check.version, check.bytes_read, tier)
    if shard.corrupt:  # failed its checksum on an earlier read; refused until a restart
        detail = f"{shard.corrupt} (slot {check.slot} reads back intact now; restart the daemon to use it)"
        return Verdict(model, shard_id, "bad", detail, check.version, check.bytes_read, tier)
    detail = f"version {check.version} in slot {check.slot} matches its crc32c"
    return Verdict(model, shard_id, "ok", detail, check.version, check.bytes_read, tier)


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
