"""`offload(model, daemons=..., optimizer=...)`: what a training script calls (also
`ps_offload.offload`). It registers the model with the daemons and returns its optimizer: an
OffloadOptimizer (ps_offload.trainer.offload.whole_model), or a StreamedOptimizer
(ps_offload.trainer.stream.optimizer) when given `stream=`."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ps_offload.optimizers import config_names
from ps_offload.trainer.config import (
    ClientConfig,
    CompressionConfig,
    DeviceConfig,
    LossScaling,
    OffloadConfig,
    OptimizerConfig,
)
from ps_offload.trainer.offload.whole_model import OffloadOptimizer
from ps_offload.trainer.stream.optimizer import StreamedOptimizer
from ps_offload.trainer.stream.settings import Streaming


def check_optimizer(optimizer: object) -> None:
    """A TypeError that says what to write when `optimizer` is not one of our optimizers'
    configs (torch's own optimizer classes are the usual mistake)."""
    if isinstance(optimizer, OptimizerConfig) and type(optimizer).__name__ in config_names():
        return
    name = getattr(optimizer, "__name__", None) or type(optimizer).__name__
    hint = " (torch.optim's: the daemons run ours, with the same arguments)" if "torch" in repr(optimizer) else ""
    choices = " or ".join(f"ps_offload.{n}(lr=...)" for n in config_names())
    raise TypeError(f"optimizer= takes {choices}, an instance, got {name}{hint}")


def offload(
    model: nn.Module,
    *,
    daemons: list[str],
    optimizer: OptimizerConfig,
    no_weight_decay: Callable[[str, nn.Parameter], bool] | None = None,
    config: OffloadConfig | None = None,
    compression: CompressionConfig | None = None,
    client: ClientConfig | None = None,
    device: DeviceConfig | None = None,
    loss_scaling: LossScaling | None = None,
    stream: Streaming | None = None,
) -> OffloadOptimizer | StreamedOptimizer:
    """Registers `model` with the daemons and returns its optimizer (a torch.optim.Optimizer).

    daemons: the ordered daemon list (part of the shard plan; see `daemon_addresses()`).
    optimizer: AdamW or SGD, run by the daemons.
    no_weight_decay: (name, param) -> True for parameters that get no weight decay (they
        form param group 1; nanoGPT's rule is `param.dim() < 2`).
    config: model name, shard size, staleness (delayed update), push share.
    compression: how the gradients travel; `opt.bytes_pushed` counts what was sent.
    client: timeouts, retries, transport, TLS and token.
    device: the host buffers that carry shards to and from an accelerator.
    loss_scaling: for float16 parameters (default LossScaling()); None elsewhere.
    stream: train with only a window of blocks on the trainer (trainer/stream/optimizer.py); the
        model may then be built on the meta device.
    """
    check_optimizer(optimizer)  # (the daemon list is checked by ShardedClient, before any call)
    if stream is not None:
        if compression is not None or loss_scaling is not None:
            raise ValueError("streaming does not take compression or loss_scaling yet")
        return StreamedOptimizer(
            model, stream, daemons=daemons, optimizer=optimizer, no_weight_decay=no_weight_decay, config=config,
            client=client, device=device,
        )  # fmt: skip
    return OffloadOptimizer(
        model, daemons=daemons, optimizer=optimizer, no_weight_decay=no_weight_decay, config=config,
        compression=compression, client=client, device=device, loss_scaling=loss_scaling,
    )  # fmt: skip
