"""Optimizers as plug-ins: one module each, one table. The daemons step shards with them; the
trainer turns torch param_groups into their settings and audits them against their reference.

    base     the contract: OptimizerConfig, GroupSettings, ShardState, OptimizerPlugin
    fused    what AdamW and SGD share: torch's fused CPU kernels over kernel runs, the one-pass
             kernel once calibrated, the audit's recompute with torch.optim itself
    adamw    AdamW (bit for bit with torch.optim.AdamW(fused=True); bf16 state; 1-bit Adam)
    sgd      SGD with momentum (bit for bit with torch.optim.SGD(fused=True))
    lamb     LAMB (whole parameters: a trust ratio per parameter)
    adafactor Adafactor (whole parameters: a factored second moment; bit for bit with
             torch.optim.Adafactor)

Adding one: a module with its config dataclass and its OptimizerPlugin, its tests, and a line
of `TABLE` below. Nothing else names an optimizer.
"""

from __future__ import annotations

from ps_offload.optimizers import adafactor, adamw, lamb, sgd
from ps_offload.optimizers.adafactor import Adafactor
from ps_offload.optimizers.adamw import AdamW
from ps_offload.optimizers.base import GroupSettings, OptimizerConfig, OptimizerPlugin, ShardState
from ps_offload.optimizers.lamb import LAMB
from ps_offload.optimizers.sgd import SGD
from ps_offload.proto import ps_pb2

TABLE: dict[str, OptimizerPlugin] = {
    plugin.name: plugin for plugin in (adamw.PLUGIN, sgd.PLUGIN, lamb.PLUGIN, adafactor.PLUGIN)
}
_BY_CONFIG = {plugin.config_type: plugin for plugin in TABLE.values()}


def plugin_of(config: OptimizerConfig) -> OptimizerPlugin:
    """The plug-in that runs `config` (TypeError for anything that is not one of the table's configs)."""
    plugin = _BY_CONFIG.get(type(config))
    if plugin is None:
        raise TypeError(f"{type(config).__name__} is not an optimizer of ours (one of {', '.join(names())})")
    return plugin


def plugin_named(name: str) -> OptimizerPlugin:
    """The plug-in called `name` (KeyError saying which there are)."""
    plugin = TABLE.get(name)
    if plugin is None:
        raise KeyError(f"no optimizer {name!r} (this build runs {', '.join(names())})")
    return plugin


def plugin_for_spec(spec: ps_pb2.OptimizerSpec) -> OptimizerPlugin:
    """The plug-in an OptimizerSpec names: AdamW and SGD by their own messages, any other by
    PluginOptimizerSpec.name (KeyError when it names none, or nothing)."""
    which = spec.WhichOneof("kind")
    if which is None:
        raise KeyError(f"no optimizer given (one of {', '.join(names())})")
    return plugin_named(spec.plugin.name if which == "plugin" else which)


def state_tensors(spec: ps_pb2.ModelSpec) -> list[tuple[str, int]]:
    """The optimizer state a shard holds besides its master values: (its name in an export, the
    ShardTensor a pull asks for: EXP_AVG, EXP_AVG_SQ by position), in the order a STATE push
    lays them out after the master (a snapshot restore, a replica repaired)."""
    plugin = plugin_for_spec(spec.optimizer)
    config = plugin.from_proto(spec.optimizer)
    return list(zip(plugin.state_names(config), (ps_pb2.EXP_AVG, ps_pb2.EXP_AVG_SQ), strict=False))


def names() -> list[str]:
    return sorted(TABLE)


def config_names() -> list[str]:
    """The configs' class names, as a user writes them (ps_offload.AdamW, ...)."""
    return [plugin.config_type.__name__ for plugin in TABLE.values()]


__all__ = [
    "TABLE", "AdamW", "SGD", "LAMB", "Adafactor", "GroupSettings", "OptimizerConfig", "OptimizerPlugin", "ShardState",
    "plugin_of", "plugin_named", "plugin_for_spec", "state_tensors", "names", "config_names",
]  # fmt: skip
