"""What the two daemon-backed optimizers share: the torch.optim.Optimizer face and the
registration of a model with the daemons.

    OffloadOptimizer   the whole model stays on the trainer (trainer/offload/whole_model.py)
    StreamedOptimizer  only a window of blocks does (trainer/stream/optimizer.py)

Both are a torch.optim.Optimizer whose `param_groups` travel with every step (trainer/
offload/param_groups.py), whose `state_dict()` names the model and the version on the daemons, and
whose float16 models get dynamic loss scaling (trainer/offload/loss_scale.py). A subclass sets `io`
(a ShardIO: its byte count and host buffers are reported here) and `step_count`, and defines
`synchronize()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ps_offload.optimizers import plugin_of
from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.config import (
    ClientConfig,
    LossScaling,
    OffloadConfig,
    OptimizerConfig,
    expect_config,
)
from ps_offload.trainer.io.device import WIRE_DTYPES
from ps_offload.trainer.offload.loss_scale import LossScaler
from ps_offload.trainer.offload.param_groups import GroupTracker, defaults_of, initial_groups
from ps_offload.trainer.wire.sharded_client import ShardedClient

log = logging.getLogger(__name__)

STATE_WIRE_DTYPES = {"float32": ps_pb2.FLOAT32, "bfloat16": ps_pb2.BFLOAT16}
"""OffloadConfig.state_dtype as ModelSpec.state_dtype."""


def check_replicable(replicas: int, optimizer: OptimizerConfig) -> None:
    """Replicas are repaired by copying state element by element: refused for factored state
    (Adafactor) before anything is registered (the daemons would refuse it too)."""
    plugin = plugin_of(optimizer)
    if replicas > 1 and not plugin.per_element_state:
        raise ValueError(
            f"OffloadConfig.replicas={replicas}: {plugin.name} keeps factored state, which a lost replica cannot be "
            "repaired from (repair copies state element by element); use replicas=1"
        )


def check_state_dtype(state_dtype: str, compute_dtype: torch.dtype, optimizer: OptimizerConfig) -> None:
    """bf16 state keeps the model's own bf16 parameters as the master values, for an optimizer
    that steps bf16 state exactly (OptimizerPlugin.state_dtypes: AdamW): refused otherwise,
    before anything is registered (the daemons would refuse it too)."""
    if state_dtype == "float32":
        return
    plugin = plugin_of(optimizer)
    if state_dtype not in plugin.state_dtypes:
        raise ValueError(
            f"OffloadConfig.state_dtype={state_dtype!r} is not one {plugin.name} keeps "
            f"({', '.join(plugin.state_dtypes)}){plugin.state_dtype_note}; keep state_dtype='float32'"
        )
    if compute_dtype != torch.bfloat16:
        raise ValueError(
            f"OffloadConfig.state_dtype='bfloat16' keeps the model's bf16 parameters themselves as the master "
            f"values, but the model's parameters are {compute_dtype}: cast the model (model.to(torch.bfloat16)) "
            "or keep state_dtype='float32'"
        )


class DaemonOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose state and update live on the daemons."""

    io: object  # trainer/io/shard_io.py ShardIO, set by the subclass
    step_count: int

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        *,
        daemons: list[str],
        optimizer: OptimizerConfig,
        no_weight_decay: Callable[[str, nn.Parameter], bool] | None,
        config: OffloadConfig | None,
        client: ClientConfig | None,
        loss_scaling: LossScaling | None,
        starts_shard: set[str] = frozenset(),
    ) -> None:
        """Registers `named` (the trainable parameters, in the flat layout's order; all of one
        dtype) with the daemons and sets `plan`. `starts_shard`: the names of the parameters
        a shard must begin at (the first of each streamed block)."""
        self.config = expect_config(config, OffloadConfig, "config")
        client = expect_config(client, ClientConfig, "client")
        compute_dtype = named[0][1].dtype
        if loss_scaling is None and compute_dtype == torch.float16:
            loss_scaling = LossScaling()
        self.loss_scaler = None
        if loss_scaling is not None:  # expect_config would make a default one of None
            self.loss_scaler = LossScaler(expect_config(loss_scaling, LossScaling, "loss_scaling"))
        check_state_dtype(self.config.state_dtype, compute_dtype, optimizer)
        check_replicable(self.config.replicas, optimizer)
        groups, group_of = initial_groups(named, no_weight_decay)
        # The groups' own weight decay (no_weight_decay's 0), before torch fills in defaults.
        decay_overrides = [group.get("weight_decay") for group in groups]
        super().__init__(groups, defaults_of(optimizer))
        self._groups = GroupTracker(self.param_groups, optimizer)
        self.optimizer = optimizer
        self.client = ShardedClient(daemons, config=client)
        spec = ps_pb2.ModelSpec(
            model=self.config.model_name, optimizer=optimizer.to_proto(), shard_bytes=self.config.shard_bytes,
            replicas=self.config.replicas, state_dtype=STATE_WIRE_DTYPES[self.config.state_dtype],
        )  # fmt: skip
        for (name, p), group in zip(named, group_of, strict=True):
            param = spec.params.add(
                name=name, shape=list(p.shape), dtype=WIRE_DTYPES.get(p.dtype, 0), group=group,
                starts_shard=name in starts_shard,
            )  # fmt: skip
            if decay_overrides[group] is not None:  # for pushes without groups (1-bit Adam's)
                param.weight_decay = decay_overrides[group]
        self.plan: list[ShardSlice] = self.client.register(spec)
        self.closed = False  # set by close(): step() then says so, not a thread pool's error

    def say_if_resumed(self) -> None:
        """A WARNING (shown without any logging set up) when the daemons held this model's state
        already: a script run again under the same model name continues the old run."""
        if self.step_count:
            log.warning(
                "resuming model %r at step %d from the daemons' state (%s); to start another run, give it "
                "another OffloadConfig(model_name=...), or delete this one with ps-admin drop",
                self.client.model, self.step_count, ", ".join(self.client.daemons),
            )  # fmt: skip

    def replace_daemon(self, old: str, new: str) -> None:
        """Puts the daemon at `new` in the place of `old`, a lost holder of a replicated model
        (OffloadConfig.replicas): before the next step's pushes, `new`, which must hold none of
        this model, gets a copy of every shard `old` held, from their live replicas."""
        self.client.replace_daemon(old, new)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                "this optimizer was closed (close(), or the end of its `with offload(...)` block); make a new one "
                "with offload() to train on: it resumes from the daemons' state"
            )

    def synchronize(self) -> None:
        raise NotImplementedError

    @property
    def bytes_pushed(self) -> int:
        """Payload bytes of this process's gradient pushes that the daemons applied."""
        return self.io.bytes_pushed

    @property
    def host_buffer_bytes(self) -> int:
        """Bytes of host buffers (pinned on an accelerator) this optimizer holds; bounded by
        DeviceConfig.host_buffers shards."""
        return self.io.mover.host_bytes

    @property
    def lr(self) -> float:
        """Group 0's learning rate; setting it sets every group's (a StepOptimizer's schedule)."""
        return float(self.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.param_groups:
            group["lr"] = value

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_groups"):  # after __init__: the daemons' grouping is fixed
            raise ValueError("param groups cannot be added after offload(): the daemons were registered with them")
        super().add_param_group(param_group)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward() on: times the loss scale for float16 parameters, as is
        otherwise."""
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler else loss

    def state_dict(self) -> dict:
        state = super().state_dict()
        self.synchronize()
        state["ps_offload"] = {
            "model": self.client.model,
            "version": self.step_count,
            "daemons": list(self.client.daemons),
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
        }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the param groups and the loss scale; the daemons must hold the version the
        state dict was taken at (they keep only their newest)."""
        saved = state_dict.get("ps_offload")
        if saved is None:
            raise ValueError("not a ps-offload optimizer state dict (no 'ps_offload' entry)")
        self.synchronize()
        if saved["model"] != self.client.model or saved["version"] != self.step_count:
            raise ValueError(
                f"the state dict is of model {saved['model']!r} at version {saved['version']}, the daemons hold "
                f"{self.client.model!r} at version {self.step_count}: the daemons keep only their newest state, "
                "so resume from the checkpoint saved last"
            )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "ps_offload"})
        if self.loss_scaler and saved["loss_scaler"]:
            self.loss_scaler.load_state_dict(saved["loss_scaler"])


def check_uniform(named: list[tuple[str, nn.Parameter]]) -> None:
    """One device and one dtype for all parameters (one flat buffer each)."""
    first_name, first = named[0]
    for name, p in named:
        if p.device != first.device or p.dtype != first.dtype:
            raise ValueError(
                f"parameter {name!r} is {p.dtype} on {p.device}, {first_name!r} is {first.dtype} on {first.device}: "
                "offload() takes a model whose parameters share one device and one dtype"
            )
