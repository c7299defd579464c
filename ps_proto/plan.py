"""The shard plan: which slice of a model's parameters each shard holds and which daemon
owns it. Pure data and pure functions, computed identically by every trainer and daemon,
so no coordinator is needed.

A model's parameters are flattened and concatenated in spec order (the forward order) into
one fp32 index space of `total_numel` elements. That space is cut at the chosen starts (the
first element of every parameter whose ParamSpec says starts_shard: a streamed block and
what follows it begin on a shard of their own; see `shard_starts`) and, from each cut on,
every `shard_numel` elements: shards of exactly `shard_numel` elements, the last one before
a cut or the end shorter. Without starts, shard i is the contiguous slice
[i * shard_numel, min((i + 1) * shard_numel, total_numel)). A large parameter spans several
shards; small ones share a shard. Shard ids therefore depend only on the layout, the starts
and the shard size, never on the daemon list.

Cuts fall at any offset inside a parameter (no padding, so the flat space, the wire format
and the NVMe records do not depend on it); `kernel_runs` tells the daemon how to step a
piece of a parameter so that the result is still bit-identical to torch.optim's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

FP32_BYTES = 4
# Shard sizes are whole 4 KiB pages of fp32, so shard arenas are whole pages for vector
# kernels and for O_DIRECT I/O (a shard that ends at a chosen start or at the model's end is
# shorter; the arena rounds it up).
SHARD_ALIGN_BYTES = 4096
# torch's fused CPU optimizer kernels (_fused_adamw_, _fused_sgd_: what AdamW(fused=True) and
# SGD(fused=True) run) compute element p of a tensor of n elements in a SIMD body when
# p < n - n % V and in a scalar tail loop otherwise, V = at::vec::Vectorized<float>::size()
# (8 on this torch's AVX2 and AVX512 builds, measured; the thread split, in 16-element cache
# lines, does not move it). The two loops round differently (they agree when torch runs its
# no-FMA build, ATEN_CPU_CAPABILITY=default: a fused multiply-add in one of them, it seems),
# so a piece of a parameter stepped as its own tensor matches torch.optim only if its tail
# falls where the whole parameter's does. Pieces handed to the kernel therefore start and
# end on multiples of KERNEL_ALIGN within the parameter (or at its end): exact for every V
# that divides it, i.e. any SIMD width up to 2048 bits.
KERNEL_ALIGN = 64


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
    daemon_index: int  # the primary
    offset: int
    numel: int
    replicas: tuple[int, ...] = ()  # the other daemons holding it (place_replicas), in order

    @property
    def end(self) -> int:
        return self.offset + self.numel

    @property
    def holders(self) -> tuple[int, ...]:
        """Every daemon holding the shard, the primary first."""
        return (self.daemon_index, *self.replicas)


@dataclass(frozen=True)
class Segment:
    """The piece of one parameter that lies inside one shard."""

    param_index: int
    shard_start: int  # element offset within the shard
    param_start: int  # element offset within the flattened parameter
    numel: int
    param_numel: int  # the whole parameter's: where torch's kernel puts its scalar tail (kernel_runs)


@dataclass(frozen=True)
class KernelRun:
    """One tensor the daemon hands torch's fused kernel for (part of) a segment.

    `context == 0`: the shard's elements [shard_start, shard_start + numel) themselves.
    Otherwise the elements are copied into a zeroed scratch tensor of `context` elements, at
    `context_start`, and copied back after the step; the scratch stands for the aligned block
    of the parameter they lie in (see kernel_runs)."""

    shard_start: int  # element offset within the shard
    numel: int
    context: int = 0
    context_start: int = 0


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


def shard_starts(layouts: Sequence[ParamLayout], flags: Sequence[bool]) -> list[int]:
    """The offsets at which a shard must start, from the per-parameter starts_shard flags
    (ParamSpec.starts_shard, one per layout): each flagged parameter's first element, sorted,
    without duplicates, and neither 0 nor the end of the flat space (a flag on the first
    parameter, or on parameters of 0 elements at the end: nothing to cut there). A flagged parameter of 0
    elements elsewhere cuts where the next parameter begins."""
    if len(flags) != len(layouts):
        raise PlanError(f"{len(flags)} starts_shard flags for {len(layouts)} parameters")
    total = sum(layout.numel for layout in layouts)
    return sorted(
        {layout.offset for layout, flag in zip(layouts, flags, strict=True) if flag and 0 < layout.offset < total}
    )


def _cuts(starts: Sequence[int], total_numel: int) -> list[int]:
    """`starts` sorted, without duplicates and without 0; each must be 0 or inside (0, total_numel)."""
    outside = [s for s in starts if s != 0 and not 0 < s < total_numel]
    if outside:
        raise PlanError(f"shard starts {sorted(outside)[:8]} lie outside the model's (0, {total_numel}) elements")
    return sorted(set(starts) - {0})


def plan_shards(total_numel: int, shard_numel: int, num_daemons: int, starts: Sequence[int] = ()) -> list[ShardSlice]:
    """Cuts [0, total_numel) into shards and assigns each to the daemon holding the fewest
    elements so far (ties: the lowest index). A shard begins at every offset in `starts`
    (0 and duplicates are ignored; see shard_starts) and every `shard_numel` elements after
    the previous cut; the piece before a cut or the end may be shorter. With equal shards the
    assignment is round-robin, so shards that the forward pass needs one after another sit
    on different daemons and are pulled in parallel. Without starts the plan is the one of
    equal shards that existing NVMe files were written under."""
    if num_daemons < 1:
        raise PlanError("the daemon list is empty")
    if shard_numel < 1:
        raise PlanError(f"shard_numel must be positive, got {shard_numel}")
    cuts = _cuts(starts, total_numel)
    load = [0] * num_daemons
    shards: list[ShardSlice] = []
    for begin, stop in zip([0, *cuts], [*cuts, total_numel], strict=True):
        for offset in range(begin, stop, shard_numel):
            numel = min(shard_numel, stop - offset)
            daemon = min(range(num_daemons), key=lambda d: (load[d], d))
            load[daemon] += numel
            shards.append(ShardSlice(len(shards), daemon, offset, numel))
    validate_plan(shards, total_numel=total_numel, shard_numel=shard_numel, num_daemons=num_daemons, starts=cuts)
    return shards


def whole_param_plan(
    layouts: Sequence[ParamLayout], shard_numel: int, num_daemons: int, starts: Sequence[int] = ()
) -> list[ShardSlice]:
    """The plan of an optimizer that reads whole parameters (a norm per parameter: LAMB): no
    parameter is cut. Parameters are packed in order, a new shard starting where the next one
    would overflow `shard_numel` or at a start (`shard_starts`); a parameter larger than
    `shard_numel` is a shard of its own, as long as itself. Daemons are assigned as in
    plan_shards (the fewest elements so far)."""
    if num_daemons < 1:
        raise PlanError("the daemon list is empty")
    if shard_numel < 1:
        raise PlanError(f"shard_numel must be positive, got {shard_numel}")
    total = sum(layout.numel for layout in layouts)
    cuts, forced, fill = [], set(_cuts(starts, total)), 0
    for layout in layouts:
        if layout.offset and ((fill and fill + layout.numel > shard_numel) or layout.offset in forced):
            if layout.offset < total and (not cuts or cuts[-1] != layout.offset):
                cuts.append(layout.offset)
            fill = 0
        fill += layout.numel
    load = [0] * num_daemons
    shards: list[ShardSlice] = []
    for begin, stop in zip([0, *cuts], [*cuts, total], strict=True):
        daemon = min(range(num_daemons), key=lambda d: (load[d], d))
        load[daemon] += stop - begin
        shards.append(ShardSlice(len(shards), daemon, begin, stop - begin))
    validate_whole_param_plan(shards, layouts, shard_numel=shard_numel, num_daemons=num_daemons)
    return shards


def validate_whole_param_plan(
    shards: list[ShardSlice], layouts: Sequence[ParamLayout], *, shard_numel: int, num_daemons: int
) -> None:
    """Invariants of a whole-parameter plan: ids 0..n-1 in order; the slices tile the model;
    every cut falls where a parameter begins; a shard longer than `shard_numel` holds one
    parameter; every daemon index is in range."""
    total = sum(layout.numel for layout in layouts)
    begins = {layout.offset for layout in layouts}
    expected = 0
    for position, shard in enumerate(shards):
        where = f"shard {shard.shard_id} (position {position})"
        if shard.shard_id != position or shard.offset != expected or shard.numel < 1:
            raise PlanError(f"{where}: shards must tile the model in order, ids 0..n-1")
        if shard.offset not in begins:
            raise PlanError(f"{where}: starts at {shard.offset}, inside a parameter")
        held = [p for p in layouts if shard.offset <= p.offset < shard.end and p.numel]
        if shard.numel > shard_numel and len(held) > 1:
            raise PlanError(f"{where}: has {shard.numel} elements, more than {shard_numel}, and several parameters")
        if not 0 <= shard.daemon_index < num_daemons:
            raise PlanError(f"{where}: daemon index {shard.daemon_index} not in [0, {num_daemons})")
        expected = shard.end
    if expected != total:
        raise PlanError(f"shards cover {expected} elements, the model has {total}")


def plan_model(
    layouts: Sequence[ParamLayout],
    starts_shard: Sequence[bool],
    shard_bytes: int,
    num_daemons: int,
    replicas: int,
    *,
    whole_params: bool,
) -> list[ShardSlice]:
    """A model's plan as every trainer and daemon computes it: shards cut at the flagged starts
    (`shard_starts`), never inside a parameter when its optimizer reads whole parameters
    (`whole_param_plan`), each on its primary and `replicas` - 1 more daemons."""
    starts = shard_starts(layouts, starts_shard)
    shard_numel = shard_numel_for(shard_bytes)
    if whole_params:
        plan = whole_param_plan(layouts, shard_numel, num_daemons, starts)
    else:
        plan = plan_shards(sum(layout.numel for layout in layouts), shard_numel, num_daemons, starts)
    return place_replicas(plan, num_daemons, replicas)


def place_replicas(shards: list[ShardSlice], num_daemons: int, replicas: int) -> list[ShardSlice]:
    """The plan with each shard on `replicas` daemons: replica j of a shard whose primary is p
    is daemon (p + j * (num_daemons // replicas)) mod num_daemons, as far apart in the list as
    the count allows (distinct, as step * replicas <= num_daemons). It depends on the daemons'
    number and order only, as the plan does, so a daemon moved to another address keeps its
    shards; a list written node by node (the same number of daemons on each) puts a shard's
    replicas on different nodes. replicas 0 or 1: the plan as it is."""
    if replicas <= 1:
        return shards
    if replicas > num_daemons:
        raise PlanError(f"{replicas} replicas need at least {replicas} daemons, the list has {num_daemons}")
    step = num_daemons // replicas
    return [
        dataclasses.replace(s, replicas=tuple((s.daemon_index + j * step) % num_daemons for j in range(1, replicas)))
        for s in shards
    ]


def validate_plan(
    shards: list[ShardSlice], *, total_numel: int, shard_numel: int, num_daemons: int, starts: Sequence[int] = ()
) -> None:
    """Invariants of a plan (`starts` as for plan_shards):
    1. ids are 0..n-1 in order;
    2. the slices tile [0, total_numel) in order, without gaps or overlaps;
    3. every shard has 1..shard_numel elements;
    4. a shard shorter than shard_numel ends at a start or at total_numel;
    5. every start is some shard's offset;
    6. every daemon index is in range;
    7. balance: the elements of any two daemons differ by at most shard_numel.
    2 to 5 leave one plan per (total_numel, shard_numel, starts): no shard straddles a start
    (5), and between two starts every shard but the last is full (4).
    """
    cuts = _cuts(starts, total_numel)
    ends = {*cuts, total_numel}
    expected_offset = 0
    load = [0] * num_daemons
    for position, shard in enumerate(shards):
        where = f"shard {shard.shard_id} (position {position})"
        if shard.shard_id != position:
            raise PlanError(f"{where}: ids must run 0..n-1 in order")
        if shard.offset != expected_offset:
            raise PlanError(f"{where}: starts at {shard.offset}, expected {expected_offset}")
        if not 1 <= shard.numel <= shard_numel:
            raise PlanError(f"{where}: has {shard.numel} elements, shard size is {shard_numel}")
        # (The last shard must end at total_numel, which the coverage check below says.)
        if shard.numel < shard_numel and shard.end not in ends and position < len(shards) - 1:
            raise PlanError(
                f"{where}: has {shard.numel} elements, fewer than {shard_numel}, but ends at {shard.end}, "
                f"neither a shard start nor the model's end {total_numel}"
            )
        if not 0 <= shard.daemon_index < num_daemons:
            raise PlanError(f"{where}: daemon index {shard.daemon_index} not in [0, {num_daemons})")
        load[shard.daemon_index] += shard.numel
        expected_offset = shard.end
    if expected_offset != total_numel:
        raise PlanError(f"shards cover {expected_offset} elements, the model has {total_numel}")
    missed = sorted(set(cuts) - {s.offset for s in shards})
    if missed:
        raise PlanError(f"no shard starts at {missed[:8]}, which must begin one")
    if shards and max(load) - min(load) > shard_numel:
        raise PlanError(f"unbalanced plan: elements per daemon {load}")


def segments_of(shard: ShardSlice, layouts: list[ParamLayout]) -> list[Segment]:
    """The parameter pieces inside `shard`, in order. The optimizer steps each piece on its
    own (never the shard as one tensor), split by kernel_runs where a shard cut falls inside
    a parameter, so that its kernel computes every element in the same loop as torch.optim's
    call on the whole parameter, which makes results bit-identical."""
    segments = []
    for layout in layouts:
        start = max(layout.offset, shard.offset)
        end = min(layout.offset + layout.numel, shard.end)
        if start < end:
            segments.append(
                Segment(layout.index, start - shard.offset, start - layout.offset, end - start, layout.numel)
            )
    return segments


def kernel_runs(segment: Segment, align: int = KERNEL_ALIGN) -> list[KernelRun]:
    """How the daemon steps `segment` so that every element lands in the same kernel loop
    (SIMD body or scalar tail) as in torch.optim's call on the whole parameter.

    Shard cuts fall anywhere inside a parameter (parameters are packed end to end, and a
    shard is a whole number of pages of the flat space from the previous cut), so a segment is split at the
    parameter's `align`-element blocks: the whole blocks in the middle run in place as one
    tensor; a partial block at either end (the segment starts or stops inside it) runs in
    a scratch tensor as long as that block, at its place in the block. A segment that is a
    whole parameter is one run in place. At most three runs: partial, in place, partial."""
    if align < 1:
        raise PlanError(f"align must be positive, got {align}")
    n = segment.param_numel
    first, end = segment.param_start, segment.param_start + segment.numel

    def block(p: int) -> tuple[int, int]:  # the aligned block of the parameter holding element p
        start = p - p % align
        return start, min(start + align, n)

    def run(p: int, stop: int, context: int = 0, context_start: int = 0) -> KernelRun:
        return KernelRun(segment.shard_start + p - first, stop - p, context, context_start)

    runs, p = [], first
    if p < end and p % align:  # starts inside a block
        start, stop = block(p)
        runs.append(run(p, min(end, stop), stop - start, p - start))
        p = min(end, stop)
    # Whole blocks (the parameter's last block counts as whole when the segment reaches it).
    in_place_end = end if end == n or end % align == 0 else end - end % align
    if p < in_place_end:
        runs.append(run(p, in_place_end))
        p = in_place_end
    if p < end:  # stops inside a block (p is that block's start here)
        start, stop = block(p)
        runs.append(run(p, end, stop - start, 0))
    validate_kernel_runs(segment, runs, align)
    return runs


def validate_kernel_runs(segment: Segment, runs: list[KernelRun], align: int = KERNEL_ALIGN) -> None:
    """Invariants of a segment's kernel runs (kernel_runs). The tensor a run hands the
    kernel stands for parameter elements [lo, hi): lo = the run's own first element in
    place, that minus `context_start` in a scratch.
    1. the runs tile the segment's shard range [shard_start, shard_start + numel) in order,
       none empty;
    2. lo is a multiple of `align` (a block start of the parameter);
    3. hi is a multiple of `align` or the parameter's end, and hi <= param_numel;
    4. a scratch run lies inside its scratch tensor, which is at most one block long;
    5. at most one run is in place, and scratch runs come only first or last (<= 3 runs).
    Hence, for any SIMD width V dividing `align`, element j of a run's tensor is the
    parameter's element lo + j, and j < (hi - lo) - (hi - lo) % V exactly when
    lo + j < n - n % V: each element goes through the same loop of torch's fused kernel
    (vector body or scalar tail) as in torch.optim's call on the whole parameter, so the
    update is bit-identical. Padding a scratch tensor with zeros changes nothing else: the
    kernels are elementwise."""
    n = segment.param_numel
    if segment.param_start < 0 or segment.numel < 1 or segment.param_start + segment.numel > n:
        raise PlanError(f"segment {segment} lies outside its parameter of {n} elements")
    position = segment.shard_start
    in_place = 0
    for i, r in enumerate(runs):
        where = f"run {i} {r} of segment {segment}"
        if r.shard_start != position or r.numel < 1:
            raise PlanError(f"{where}: runs must tile the segment in order, expected a start of {position}")
        position += r.numel
        own = segment.param_start + r.shard_start - segment.shard_start
        if r.context == 0:
            in_place += 1
            lo, hi = own, own + r.numel
            if r.context_start != 0:
                raise PlanError(f"{where}: an in-place run has no context_start")
        else:
            lo, hi = own - r.context_start, own - r.context_start + r.context
            if not (0 <= r.context_start and r.context_start + r.numel <= r.context <= align):
                raise PlanError(f"{where}: must lie inside a scratch of at most one block ({align})")
            if 0 < i < len(runs) - 1:
                raise PlanError(f"{where}: scratch runs come only first or last")
        if lo % align:
            raise PlanError(f"{where}: its kernel tensor starts at parameter element {lo}, not a multiple of {align}")
        if hi > n or (hi % align and hi != n):
            raise PlanError(
                f"{where}: its kernel tensor ends at parameter element {hi}, "
                f"neither a multiple of {align} nor the parameter's end {n}"
            )
    if position != segment.shard_start + segment.numel:
        raise PlanError(f"runs of segment {segment} cover {position - segment.shard_start} elements")
    if in_place > 1:
        raise PlanError(f"segment {segment}: {in_place} in-place runs, at most one")
