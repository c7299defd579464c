"""What one registration may ask of a daemon, checked before any work: a request that would
build a plan of a billion shards under the store's lock, or allocate arenas past the RAM
budget before finding out, must be refused first, by arithmetic on the spec alone.

* `store.max_models`: models registered at once on this daemon.
* `store.max_shards_per_model`: the shards a model's plan may have (all daemons' together):
  at most ceil(numel / shard numel) plus one per parameter that starts a shard, counted
  before the plan is built.
* RAM (without an NVMe tier): the arenas of this daemon's shards, summed from the plan's
  sizes before any arena is allocated.

Each refusal is RESOURCE_EXHAUSTED saying which limit, its value, and how to raise it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps_offload.daemon.errors import ResourceExhausted
from ps_offload.daemon.model.spec import ModelSpec
from ps_offload.daemon.store.shard import arena_nbytes
from ps_offload.optimizers import plugin_of
from ps_offload.proto.plan import ShardSlice, layout_params, segments_of, shard_numel_for


@dataclass(frozen=True)
class StoreLimits:
    max_models: int = 256
    max_shards_per_model: int = 1 << 18


def check_model_count(limits: StoreLimits, registered: int, name: str) -> None:
    if registered >= limits.max_models:
        raise ResourceExhausted(
            f"model {name!r}: this daemon holds {registered} models already (store.max_models = {limits.max_models}); "
            "raise store.max_models, or register it on other daemons"
        )


def check_plan_size(limits: StoreLimits, spec: ModelSpec) -> None:
    """Refuses a plan of more shards than the limit, counted without building it."""
    layouts = layout_params([(p.name, p.shape, p.weight_decay) for p in spec.params])
    total = sum(p.numel for p in layouts)
    per_shard = shard_numel_for(spec.shard_bytes)
    most = -(-total // per_shard) + sum(1 for p in spec.params if p.starts_shard)
    if plugin_of(spec.optimizer).whole_params:  # packed whole: two neighbours overfill a shard, or one is alone
        most = min(len(spec.params), 2 * most + 1)
    if most > limits.max_shards_per_model:
        raise ResourceExhausted(
            f"model {spec.model!r}: {total} values in shards of {per_shard} make up to {most} shards, more than "
            f"store.max_shards_per_model = {limits.max_shards_per_model}; use larger shards (ModelSpec.shard_bytes), "
            "or raise store.max_shards_per_model"
        )


def arena_bytes(plan: list[ShardSlice], daemon_index: int, spec: ModelSpec) -> list[int]:
    """The arena bytes (master and optimizer state) of each of this daemon's shards."""
    plugin = plugin_of(spec.optimizer)
    layouts = layout_params([(p.name, p.shape, p.weight_decay) for p in spec.params])
    out = []
    for s in plan:
        if daemon_index in s.holders:
            sizes = None  # one state value per element: no need to look at the shard's parameters
            if not plugin.per_element_state:
                shapes = [layouts[seg.param_index].shape for seg in segments_of(s, layouts)]
                sizes = plugin.state_numels(spec.optimizer, shapes, s.numel)
            out.append(arena_nbytes(s.numel, spec.optimizer, spec.state_dtype, sizes))
    return out


def check_ram(name: str, arenas: list[int], *, ram_bytes: int, used: int | None) -> None:
    """`arenas`: the bytes of each shard this daemon would hold. With an NVMe tier (`used`
    None) the largest shard must fit the RAM tier (the rest waits on disk); RAM only, all of
    them must fit beside the `used` bytes."""
    if not arenas:
        return
    if used is None:
        if max(arenas) > ram_bytes:
            raise ResourceExhausted(
                f"model {name!r} has shards of {max(arenas)} bytes in RAM (master and optimizer state), "
                f"more than the RAM tier's {ram_bytes}. Raise store.ram_bytes or use smaller shards"
            )
        return
    need = sum(arenas)
    if used + need > ram_bytes:
        raise ResourceExhausted(
            f"model {name!r} needs {need} bytes on this daemon (master and optimizer "
            f"state); the RAM tier has {ram_bytes - used} of {ram_bytes} free. "
            "Raise store.ram_bytes, set store.nvme_dir, or add daemons"
        )
