"""A streamed model's parameters, cut into units that come and go together.

    units = stream_units(model, blocks, device)   # in named_parameters() order
    unit.allocate(); ...pull into unit.values...; unit.release()

A unit is one block's parameters (a streamed unit: on the device only while the block runs),
or a run of the parameters outside every block (a resident unit: embeddings, final norms,
kept on the device throughout). Each unit's parameters are views into one flat buffer in the
compute dtype, laid out as the shard plan lays them (ps_proto/plan.py's `layout_params`), and
the plan starts a shard at every unit (ParamSpec.starts_shard), so a unit is a whole number
of shards and a shard never spans two units.

A streamed unit's buffer keeps its tensor but not its memory while it is away: `release()`
resizes the storage to 0 bytes (as FSDP frees an unsharded parameter) and `allocate()` gives it
back, uninitialised, for a pull to fill. On the node's own daemon (`share_units`) a CPU model's
streamed units live at fixed addresses over a few slots of a window shared with it instead
(trainer/wire/slot_region.py): `allocate()` maps a free slot at the unit's address, so pulls
land in it in place, and `release()` hands the slot on, its pages reused by the next block.
The parameters stay the same Python objects throughout, so autograd's saved tensors, the
optimizer's param_groups and the user's references stay valid.

A model built on the meta device has no storage at all: each of its parameters becomes a view
into its unit's buffer (torch.utils.swap_tensors, so its identity stays), and its buffers
(non-parameter tensors) are allocated, uninitialised, on the device; `initialise` then runs
the modules' own `reset_parameters` (or the caller's function) one unit at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ps_offload.proto.plan import ShardSlice, layout_params
from ps_offload.trainer.wire.slot_region import SlotRegion


@dataclass(eq=False)
class StreamUnit:
    index: int
    block: nn.Module | None
    """The streamed block; None for a resident run of parameters outside every block."""
    names: list[str]
    params: list[nn.Parameter]
    start: int
    """The unit's first element in the model's flat index space."""
    values: torch.Tensor
    """The flat buffer (compute dtype, device) the parameters are views of."""
    offsets: list[int]
    """Each parameter's first element within `values`."""
    shards: list[ShardSlice] = field(default_factory=list)
    from_meta: bool = False
    """Built on the meta device: its values are for initialise() (or the daemons) to set."""
    region: SlotRegion | None = None
    """Set by share_units: `values` lie at a fixed address in a SlotRegion, given a slot of
    memory shared with the node's daemon while allocated, instead of resizing the storage."""
    resident: bool = True
    """With a region: whether the values are here (allocate() was called since release())."""

    @property
    def numel(self) -> int:
        return self.values.numel()

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def streamed(self) -> bool:
        return self.block is not None

    @property
    def nbytes(self) -> int:
        return self.numel * self.values.element_size()

    @property
    def allocated(self) -> bool:
        if self.region is not None:
            return self.resident
        return self.values.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        """Gives the buffer its memory back (uninitialised) if it was released."""
        if self.region is not None:
            if not self.resident:
                self.region.fetch(self.values)
                self.resident = True
        elif not self.allocated:
            self.values.untyped_storage().resize_(self.nbytes)

    def release(self) -> None:
        """Frees the buffer's memory; the parameters keep their shapes, not their values."""
        if not self.streamed:
            return
        if self.region is not None:
            if self.resident:
                self.region.release(self.values)
                self.resident = False
        else:
            self.values.untyped_storage().resize_(0)

    def local(self, shard: ShardSlice) -> ShardSlice:
        """The shard with its offset within `values` (what a ShardMover slices by)."""
        return dataclasses.replace(shard, offset=shard.offset - self.start)

    def modules(self, owners: dict[int, list[nn.Module]]) -> list[nn.Module]:
        """The modules whose own parameters are this unit's: the block's submodules, or the
        modules outside every block that hold the run's parameters."""
        if self.block is not None:
            return list(self.block.modules())
        seen: dict[int, nn.Module] = {}
        for p in self.params:
            for module in owners.get(id(p), []):
                seen.setdefault(id(module), module)
        return list(seen.values())


def stream_units(
    model: nn.Module, blocks: Sequence[nn.Module], device: torch.device
) -> tuple[list[StreamUnit], dict[int, list[nn.Module]]]:
    """Cuts `model`'s parameters into units and re-points each into its unit's buffer (see
    the module docstring). Returns the units in named_parameters() order and, per parameter
    id, the modules that hold it. Raises ValueError, changing nothing, for a model that
    cannot be streamed so: a block that is not a submodule, a parameter shared by a block and
    anything outside it, a block whose parameters are not one run of named_parameters()
    order, frozen parameters, or mixed dtypes. A materialised model's units stay allocated,
    holding its values (for the first push); a meta model's are released."""
    named = list(model.named_parameters())
    if not named:
        raise ValueError("the model has no trainable parameters")
    frozen = [name for name, p in named if not p.requires_grad]
    if frozen:
        raise ValueError(f"streaming trains every parameter; these are frozen: {frozen[:5]}")
    if len({p.is_meta for _, p in named}) != 1:
        raise ValueError("some of the model's parameters are on the meta device and some are not: all or none")
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        raise ValueError(f"streaming takes a model whose parameters share one dtype, got {sorted(map(str, dtypes))}")
    block_of = _block_of_params(model, blocks)
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    runs: list[tuple[int | None, list[tuple[str, nn.Parameter]]]] = []
    for name, p in named:
        owner = block_of.get(id(p))
        if runs and runs[-1][0] == owner:
            runs[-1][1].append((name, p))
        else:
            runs.append((owner, [(name, p)]))
    seen_blocks = [owner for owner, _ in runs if owner is not None]
    if len(seen_blocks) != len(set(seen_blocks)):
        raise ValueError(
            "a block's parameters must be one run of the model's named_parameters() order (a block "
            "whose parameters are interleaved with another module's cannot start its own shards)"
        )
    missing = [i for i in range(len(blocks)) if i not in seen_blocks]
    if missing:
        raise ValueError(f"blocks {missing} have no parameters")
    layouts = layout_params([(name, tuple(p.shape), None) for name, p in named])
    dtype = named[0][1].dtype
    units, position = [], 0
    for index, (owner, run) in enumerate(runs):
        offsets = [layouts[position + i].offset - layouts[position].offset for i in range(len(run))]
        numel = sum(p.numel() for _, p in run)
        values = torch.empty(numel, dtype=dtype, device=device)
        unit = StreamUnit(
            index, None if owner is None else blocks[owner], [n for n, _ in run], [p for _, p in run],
            layouts[position].offset, values, offsets,
        )  # fmt: skip
        unit.from_meta = unit.params[0].is_meta
        with torch.no_grad():
            _point_into(unit)
        if unit.from_meta:  # one unit's memory at a time, however large the model
            unit.release()
        units.append(unit)
        position += len(run)
    _materialise_buffers(model, device)
    return units, owners


def _block_of_params(model: nn.Module, blocks: Sequence[nn.Module]) -> dict[int, int]:
    """Parameter id -> the index of the block holding it; every holder of a block's parameter
    must be inside that block (else releasing the block would take it from under its other
    user)."""
    submodules = {id(m) for m in model.modules()}
    inside: dict[int, int] = {}  # module id -> block index
    for index, block in enumerate(blocks):
        if id(block) not in submodules:
            raise ValueError(f"block {index} ({type(block).__name__}) is not a submodule of the model")
        for module in block.modules():
            if id(module) in inside:
                raise ValueError(f"blocks {inside[id(module)]} and {index} share a module")
            inside[id(module)] = index
    block_of: dict[int, int] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, p in module.named_parameters(recurse=False):
            holder = inside.get(id(module))
            known = block_of.get(id(p), holder)
            if known != holder:
                where = f"{module_name}.{param_name}" if module_name else param_name
                raise ValueError(
                    f"parameter {where!r} is shared between a streamed block and a module outside it "
                    "(tied weights must both lie inside one block, or both outside every block)"
                )
            if holder is not None:
                block_of[id(p)] = holder
            else:
                block_of.setdefault(id(p), None)
    return {key: value for key, value in block_of.items() if value is not None}


PAGE = 4096


def share_units(units: list[StreamUnit], regions: Callable[..., SlotRegion | None], *, window_bytes: int) -> bool:
    """Moves the streamed units of a CPU model to fixed addresses over a few slots of a window
    shared with the node's daemon (`regions`: HostWindows.slot_region), each from a page
    boundary, so pulls land in the block's own memory, and a block's memory is a slot it holds
    while allocated: as many slots as `window_bytes` holds blocks, and one for the block that
    runs beyond it (a block fetched past them waits in private memory, pulled through a copy).
    The parameters are re-pointed (the same objects); a unit's values move with it. False,
    changing nothing, where there is no such window (no local daemon, its pool has no room, or
    not Linux)."""
    streamed = [u for u in units if u.streamed and u.values.device.type == "cpu"]
    if not streamed:
        return False
    dtype = streamed[0].values.dtype
    spans = [-(-u.nbytes // PAGE) * PAGE for u in streamed]
    slot_bytes = max(spans)
    # BlockWindow holds the blocks that fit `window_bytes` (by their bytes) and the one running.
    slots = min(len(streamed), window_bytes // min(u.nbytes for u in streamed) + 1)
    region = regions(sum(spans), slots=slots, slot_bytes=slot_bytes)
    if region is None:
        return False
    window = region.bytes.view(dtype)
    start = 0
    with torch.no_grad():
        for unit, span in zip(streamed, spans, strict=True):
            values = window[start // dtype.itemsize : start // dtype.itemsize + unit.numel]
            resident = unit.allocated
            if resident:
                region.fetch(values)
                values.copy_(unit.values)
            for p, offset in zip(unit.params, unit.offsets, strict=True):
                p.data = values[offset : offset + p.numel()].view(p.shape)
            unit.values, unit.region, unit.resident = values, region, resident
            start += span
    return True


def _point_into(unit: StreamUnit) -> None:
    """Makes each of the unit's parameters a view of its slice of `values`, its values copied
    in (a materialised model) or left for initialise() (a meta model)."""
    for p, offset in zip(unit.params, unit.offsets, strict=True):
        view = unit.values[offset : offset + p.numel()].view(p.shape)
        if p.is_meta:
            torch.utils.swap_tensors(p, nn.Parameter(view, requires_grad=p.requires_grad))
        else:
            view.copy_(p.data)
            p.data = view


def _materialise_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers still on the meta device get uninitialised storage on `device` (initialise's
    function or reset_parameters sets them, as for to_empty)."""
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def initialise(unit: StreamUnit, owners: dict[int, list[nn.Module]], init: Callable[[nn.Module], None] | None) -> None:
    """Fills a freshly allocated unit with initial values: `init(module)` on each of its
    modules, or their own `reset_parameters()`. Raises ValueError naming a parameter that
    neither set (it is filled with NaN first, so a missed one cannot pass unnoticed)."""
    with torch.no_grad():
        unit.values.fill_(float("nan"))
        for module in unit.modules(owners):
            if init is not None:
                init(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for name, p in zip(unit.names, unit.params, strict=True):
            if p.numel() and bool(torch.isnan(p).any()):
                how = "the init function" if init is not None else "a reset_parameters() of its module"
                raise ValueError(
                    f"parameter {name!r} was built on the meta device and {how} did not set all of it: "
                    "pass Streaming(init=fn), fn(module) setting the module's own parameters"
                )
