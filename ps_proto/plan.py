"""The shard plan: which slice of a model's parameters each shard holds and which daemon
owns it. Pure data and pure functions, computed identically by every trainer and daemon,
so no coordinator is needed.

A model's parameters are flattened and concatenated in spec order (the forward order) into
one fp32 index space of `total_numel` elements. That space is cut into shards of
`shard_numel` elements (the last one may be shorter): shard i is the contiguous slice
[i * shard_numel, min((i + 1) * shard_numel, total_numel)). A large parameter spans
several shards; small ones share a shard. Shard ids therefore depend only on the layout and
the shard size, never on the daemon list.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32_BYTES = 4
# Shard sizes are whole 4 KiB pages of fp32, so shard boundaries stay aligned for vector
# kernels and for O_DIRECT I/O.
SHARD_ALIGN_BYTES = 4096


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's place in the flat index space."""

    index: int
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    weight_decay: float | None  # None: the optimizer's


@dataclass(frozen=True)
class ShardSlice:
    shard_id: int
    daemon_index: int
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Segment:
    """The piece of one parameter that lies inside one shard."""

    param_index: int
    shard_start: int  # element offset within the shard
    param_start: int  # element offset within the flattened parameter
    numel: int


class PlanError(ValueError):
    """A plan or layout that breaks an invariant; the message names it."""


def shard_numel_for(shard_bytes: int) -> int:
    """Elements per shard for a byte budget, rounded down to whole 4 KiB pages."""
    if shard_bytes < SHARD_ALIGN_BYTES:
        raise PlanError(f"shard_bytes must be at least {SHARD_ALIGN_BYTES}, got {shard_bytes}")
    return (shard_bytes // SHARD_ALIGN_BYTES) * (SHARD_ALIGN_BYTES // FP32_BYTES)


def layout_params(
    params: list[tuple[str, tuple[int, ...], float | None]],
) -> list[ParamLayout]:
    """Places (name, shape, weight_decay) triples one after another in the flat space."""
    layouts, offset, seen = [], 0, set()
    for index, (name, shape, weight_decay) in enumerate(params):
        if name in seen:
            raise PlanError(f"parameter name {name!r} appears twice")
        if any(d < 0 for d in shape):
            raise PlanError(f"parameter {name!r} has a negative dimension: {shape}")
        seen.add(name)
        numel = 1
        for d in shape:
            numel *= d
        layouts.append(ParamLayout(index, name, tuple(shape), offset, numel, weight_decay))
        offset += numel
    return layouts


def plan_shards(total_numel: int, shard_numel: int, num_daemons: int) -> list[ShardSlice]:
    """Cuts [0, total_numel) into shards and assigns each to the daemon holding the fewest
    bytes so far (ties: the lowest index). With equal shards this is round-robin, so shards
    that the forward pass needs one after another sit on different daemons and are pulled
    in parallel."""
    if num_daemons < 1:
        raise PlanError("the daemon list is empty")
    if shard_numel < 1:
        raise PlanError(f"shard_numel must be positive, got {shard_numel}")
    load = [0] * num_daemons
    shards = []
    for shard_id, offset in enumerate(range(0, total_numel, shard_numel)):
        numel = min(shard_numel, total_numel - offset)
        daemon = min(range(num_daemons), key=lambda d: (load[d], d))
        load[daemon] += numel
        shards.append(ShardSlice(shard_id, daemon, offset, numel))
    validate_plan(shards, total_numel=total_numel, shard_numel=shard_numel, num_daemons=num_daemons)
    return shards


def validate_plan(shards: list[ShardSlice], *, total_numel: int, shard_numel: int, num_daemons: int) -> None:
    """Invariants of a plan:
    1. ids are 0..n-1 in order;
    2. the slices tile [0, total_numel) in order, without gaps or overlaps;
    3. every shard but the last has exactly shard_numel elements, the last at most that;
    4. every daemon index is in range;
    5. balance: the bytes of any two daemons differ by at most one shard.
    """
    expected_offset = 0
    load = [0] * num_daemons
    for position, shard in enumerate(shards):
        where = f"shard {shard.shard_id} (position {position})"
        if shard.shard_id != position:
            raise PlanError(f"{where}: ids must run 0..n-1 in order")
        if shard.offset != expected_offset:
            raise PlanError(f"{where}: starts at {shard.offset}, expected {expected_offset}")
        last = position == len(shards) - 1
        if shard.numel < 1 or shard.numel > shard_numel or (not last and shard.numel != shard_numel):
            raise PlanError(f"{where}: has {shard.numel} elements, shard size is {shard_numel}")
        if not 0 <= shard.daemon_index < num_daemons:
            raise PlanError(f"{where}: daemon index {shard.daemon_index} not in [0, {num_daemons})")
        load[shard.daemon_index] += shard.numel
        expected_offset = shard.end
    if expected_offset != total_numel:
        raise PlanError(f"shards cover {expected_offset} elements, the model has {total_numel}")
    if shards and max(load) - min(load) > shard_numel:
        raise PlanError(f"unbalanced plan: elements per daemon {load}")


def segments_of(shard: ShardSlice, layouts: list[ParamLayout]) -> list[Segment]:
    """The parameter pieces inside `shard`, in order. The optimizer runs over these views,
    one per parameter, so that its kernel walks each parameter exactly as torch.optim does
    (vector lanes and tails fall in the same places), which makes results bit-identical."""
    segments = []
    for layout in layouts:
        start = max(layout.offset, shard.offset)
        end = min(layout.offset + layout.numel, shard.end)
        if start < end:
            segments.append(Segment(layout.index, start - shard.offset, start - layout.offset, end - start))
    return segments
