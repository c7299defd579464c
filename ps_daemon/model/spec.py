"""What RegisterModel declares: the model's parameters, optimizer, shard size and daemons;
its validation, and its JSON form (kept with each model's files under nvme_dir).

Numeric bounds. Every number a model or a push carries must be finite, and in range:
* lr in [0, MAX_LR]. The kernels take lr as fp32, so a larger double does not even convert
  (lr = 1e300 used to fail with INTERNAL after the update had begun). Beyond that, a step is
  lr times a quantity that does not grow with the gradient for AdamW (|m_hat / (sqrt(v_hat)
  + eps)| is bounded by the betas: tens for common ones; 1-bit Adam caps it at R, 7.3 for
  (0.9, 0.999)), and the decay factor is 1 - lr * wd. With lr <= 1e3 and wd <= 1e3 both stay
  below 1e6 in magnitude, 32 orders short of fp32's 3.4e38, so a step of a finite shard
  stays finite; SGD's step, lr * g, stays finite for every |g| below 3.4e35. Published
  schedules use lr <= 10: the bound refuses only mistakes (a step count or a loss sent as lr).
* weight_decay in [0, MAX_WEIGHT_DECAY], the same reasoning (decay is lr * wd per step).

Param groups: ParamSpec.group numbers each parameter's group (torch.optim's param_groups) for
the per-step settings a push may carry (ps_offload.daemon.store.push). A model has max(group) + 1 groups and
each of them holds a parameter: a number left out is a trainer's bug (groups misnumbered, or a
parameter left out of the spec), refused at registration rather than found at the first push.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from ps_offload.daemon.errors import InvalidArgument
from ps_offload.optimizers import OptimizerConfig, plugin_named, plugin_of
from ps_offload.optimizers.base import check_number
from ps_offload.proto.plan import PlanError, layout_params, shard_numel_for

# The trainer's compute dtypes: whichever, the daemon keeps fp32 master values and state; a
# bf16 or fp16 trainer pushes its gradients in that dtype (widened here exactly) and pulls
# the master rounded to it (PullRequest.dtype).
SUPPORTED_COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# The dtypes the daemon may keep master values and optimizer state in (ModelSpec.state_dtype).
# bfloat16 is the state torch.optim keeps for a bf16 model's own parameters (what torchao's CPU
# offload keeps too): half the bytes moved and held per step, and bit for bit with
# AdamW(fused=True) on those bf16 parameters, because the master then is the parameter. AdamW
# only: torch 2.13's fused CPU SGD kernel, for bf16, stores no parameter in its vector loop and
# loads the bf16 momentum buffer as fp32 words (measured: 64 bf16 weights, 3 steps of lr 0.5,
# none moved), so bf16 SGD has no torch reference worth matching. Not float16: its 5-bit
# exponent underflows Adam's second moment (squares of gradients below 2**-12 flush to zero).
STATE_DTYPES = ("float32", "bfloat16")
MAX_LR = 1e3
# A model's files are <quoted name>.json, .arena and .json.tmp: within NAME_MAX (255) with room.
MAX_MODEL_NAME_QUOTED = 200
MAX_WEIGHT_DECAY = 1e3


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    weight_decay: float | None = None
    group: int = 0  # the param group: an index into a push's groups
    starts_shard: bool = False  # a shard begins at its first element (ps_proto/plan.py shard_starts)


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
    replicas: int = 1  # daemons holding each shard (ps_proto/plan.py place_replicas)
    state_dtype: str = "float32"  # master values and optimizer state (STATE_DTYPES)

    def identity(self) -> tuple:
        return (
            self.model, self.params, self.optimizer, self.shard_bytes, len(self.daemons), self.replicas,
            self.state_dtype,
        )  # fmt: skip

    @property
    def group_count(self) -> int:
        """The number of param groups (validate_spec: every one of them holds a parameter)."""
        return max(p.group for p in self.params) + 1


def check_model_name(name: str) -> None:
    """A model name names the daemon's files for it (percent-quoted, plus a suffix): it must
    fit a file name (255 bytes) on every daemon, and print as itself in logs and ps-admin."""
    if not name:
        raise InvalidArgument("the model name is empty")
    unprintable = [ch for ch in name if not ch.isprintable()]
    if unprintable:
        raise InvalidArgument(
            f"the model name {name[:64]!r} contains {unprintable[0]!r}: use printable characters only"
        )
    quoted = len(urllib.parse.quote(name, safe=""))
    if quoted > MAX_MODEL_NAME_QUOTED:
        raise InvalidArgument(
            f"the model name {name[:64]!r}... takes {quoted} bytes as a file name, at most {MAX_MODEL_NAME_QUOTED}: "
            "use a shorter name (ASCII letters, digits, '-', '_', '.' and '~' take one byte each, anything else "
            "three per UTF-8 byte)"
        )


def validate_spec(spec: ModelSpec, daemon_index: int) -> None:
    """Raises InvalidArgument naming the first field that is wrong."""
    check_model_name(spec.model)
    if not spec.params:
        raise InvalidArgument(f"model {spec.model!r} has no parameters")
    if not spec.daemons:
        raise InvalidArgument("the daemon list is empty")
    if not 0 <= daemon_index < len(spec.daemons):
        raise InvalidArgument(f"daemon_index {daemon_index} is outside the daemon list of {len(spec.daemons)}")
    if not 1 <= spec.replicas <= len(spec.daemons):
        raise InvalidArgument(
            f"model {spec.model!r}: {spec.replicas} replicas of each shard need as many daemons; the list has "
            f"{len(spec.daemons)}"
        )
    plugin = plugin_of(spec.optimizer)
    if spec.replicas > 1 and not plugin.per_element_state:
        raise InvalidArgument(
            f"model {spec.model!r}: {plugin.name} keeps factored state (not one value per element), which a lost "
            "replica cannot be repaired from (repair copies state element by element); register it with replicas 1"
        )
    for param in spec.params:
        if param.dtype not in SUPPORTED_COMPUTE_DTYPES:
            raise InvalidArgument(
                f"parameter {param.name!r}: compute dtype {param.dtype} is not supported yet "
                f"(supported: {', '.join(SUPPORTED_COMPUTE_DTYPES)})"
            )
        if param.weight_decay is not None:
            if not param.weight_decay >= 0:
                raise InvalidArgument(f"parameter {param.name!r}: weight_decay must be >= 0")
            problem = check_number(param.weight_decay, "weight_decay", low=0, high=MAX_WEIGHT_DECAY)
            if problem:
                raise InvalidArgument(f"parameter {param.name!r}: {problem}")
    _check_groups(spec)
    _check_state_dtype(spec)
    problem = _optimizer_problem(spec.optimizer)
    if problem:
        raise InvalidArgument(f"model {spec.model!r}: optimizer {problem}")
    try:
        shard_numel_for(spec.shard_bytes)
        layout_params([(p.name, p.shape, p.weight_decay) for p in spec.params])
    except (ValueError, PlanError) as exc:
        raise InvalidArgument(f"model {spec.model!r}: {exc}") from exc


def _check_groups(spec: ModelSpec) -> None:
    """Every group number from 0 to the largest holds a parameter (the module docstring)."""
    used = sorted({p.group for p in spec.params})
    if used[0] < 0:
        raise InvalidArgument(f"model {spec.model!r}: ParamSpec.group must be >= 0, got {used[0]}")
    missing = next((number for number, group in enumerate(used) if number != group), None)
    if missing is not None:  # (not a set of range(max + 1): a group may say 4e9)
        numbers = ", ".join(map(str, used[:8])) + (", ..." if len(used) > 8 else "")
        raise InvalidArgument(
            f"model {spec.model!r}: parameter groups must be numbered 0..N-1, each holding a parameter; "
            f"ParamSpec.group {missing} has none (the parameters use groups {numbers})"
        )


def _check_state_dtype(spec: ModelSpec) -> None:
    """bf16 state keeps the bf16 parameters themselves as the master (STATE_DTYPES): a
    parameter in another dtype would be rounded where torch.optim would not round it."""
    if spec.state_dtype not in STATE_DTYPES:
        raise InvalidArgument(
            f"model {spec.model!r}: state_dtype {spec.state_dtype!r} is not supported "
            f"(one of {', '.join(STATE_DTYPES)})"
        )
    if spec.state_dtype == "float32":
        return
    plugin = plugin_of(spec.optimizer)
    if spec.state_dtype not in plugin.state_dtypes:
        raise InvalidArgument(
            f"model {spec.model!r}: state_dtype {spec.state_dtype} is not one {plugin.name} keeps "
            f"({', '.join(plugin.state_dtypes)}){plugin.state_dtype_note}"
        )
    other = next((p for p in spec.params if p.dtype != spec.state_dtype), None)
    if other is not None:
        raise InvalidArgument(
            f"model {spec.model!r}: state_dtype {spec.state_dtype} keeps the parameters themselves as master values, "
            f"so every parameter must be {spec.state_dtype}; {other.name!r} is {other.dtype} (cast the model, or keep "
            "float32 state)"
        )


def _optimizer_problem(config: OptimizerConfig) -> str:
    """The bounds of the module docstring, and the plug-in's own (its config refuses what torch.optim
    refuses; NaN and inf pass some of those comparisons)."""
    bounds = [("lr", 0.0, MAX_LR), ("weight_decay", 0.0, MAX_WEIGHT_DECAY), *plugin_of(config).bounds(config)]
    for name, low, high in bounds:
        problem = check_number(getattr(config, name), name, low=low, high=high)
        if problem:
            return problem
    return ""


def spec_difference(old: ModelSpec, new: ModelSpec, old_index: int, new_index: int) -> str:
    """What makes a registration differ from the one before (for FAILED_PRECONDITION)."""
    if old_index != new_index:
        return f"this daemon is index {old_index}, the new request says {new_index}"
    if len(old.daemons) != len(new.daemons):
        return f"{len(old.daemons)} daemons before, {len(new.daemons)} now"
    for name in ("params", "optimizer", "shard_bytes", "replicas", "state_dtype"):
        if getattr(old, name) != getattr(new, name):
            if name == "params":
                for a, b in zip(old.params, new.params, strict=False):  # lengths may differ
                    if a != b:
                        return f"parameter {a.name!r} was {a}, now {b}"
                return f"{len(old.params)} parameters before, {len(new.params)} now"
            return f"{name} was {getattr(old, name)}, now {getattr(new, name)}"
    return "unknown difference"


# -- the JSON form -------------------------------------------------------------------------


def spec_to_dict(spec: ModelSpec) -> dict:
    """The spec as JSON-ready values (ps_offload.daemon.tiers.nvme writes it next to the model's slots)."""
    return {
        "model": spec.model,
        "params": [
            {
                "name": p.name,
                "shape": list(p.shape),
                "dtype": p.dtype,
                "weight_decay": p.weight_decay,
                "group": p.group,
                "starts_shard": p.starts_shard,
            }
            for p in spec.params
        ],
        "optimizer": {"type": plugin_of(spec.optimizer).name, **plugin_of(spec.optimizer).to_dict(spec.optimizer)},
        "shard_bytes": spec.shard_bytes,
        "daemons": list(spec.daemons),
        "replicas": spec.replicas,
        "state_dtype": spec.state_dtype,
    }


def spec_from_dict(data: dict) -> ModelSpec:
    """The inverse of spec_to_dict (files written before param groups: every group 0; before
    starts_shard: no flag, the plan of equal shards they were written under; before replicas: one;
    before state_dtype: float32)."""
    params = tuple(
        ParamSpec(
            p["name"], tuple(p["shape"]), p["dtype"], p["weight_decay"], p.get("group", 0), p.get("starts_shard", False)
        )
        for p in data["params"]
    )
    optimizer = dict(data["optimizer"])
    kind = optimizer.pop("type")
    config = plugin_named(kind).from_dict(optimizer)
    return ModelSpec(
        data["model"], params, config, data["shard_bytes"], tuple(data["daemons"]), data.get("replicas", 1),
        data.get("state_dtype", "float32"),
    )  # fmt: skip
