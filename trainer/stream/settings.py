"""What `offload(..., stream=Streaming(...))` is told, and the errors a streamed step raises
(trainer/stream/optimizer.py has the how)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["StepLost", "StepTorn", "Streaming"]


@dataclass(frozen=True)
class Streaming:
    """Which modules stream, and how far ahead (`offload(..., stream=Streaming(...))`)."""

    blocks: Sequence[nn.Module]
    """The streamed blocks (a GPT's transformer layers), each a submodule of the model whose
    parameters are one run of named_parameters(); everything else stays resident."""
    window_bytes: int = 1 << 30
    """Bytes of streamed blocks (compute dtype) on the device at once: the running block plus
    the ones prefetched while they fit; also the most bytes of gradients waiting for their
    pushes. One block's bytes: no prefetch."""
    prefetch: bool = True
    """Pull the next blocks ahead of their use (False: each when its hook needs it)."""
    micro_batches: int = 0
    """Backward passes per step: 0, any number (pushed as parts, applied at step()); 1, exactly
    one (each block applied as it is pushed, overlapping backward; a second backward before
    step() is refused)."""
    init: Callable[[nn.Module], None] | None = None
    """For a model built on the meta device: called on each block's modules and on each
    module outside the blocks, to set its own parameters and buffers; None: their
    `reset_parameters()`."""
    device: str | torch.device | None = None
    """Where a meta model's parameters are materialised; None: the current accelerator, or the
    CPU. A materialised model stays where it is."""
    return_freed: bool | None = None
    """What the trainer's blocks free on the host (their temporaries over 2 MiB: activations,
    gradients, widened weights) goes back to the kernel at once (True: the trainer's RSS
    follows what it holds, at a page fault per 4 KiB each time such memory is written again),
    or stays in malloc's heap for the next step (False: no faults; peak RSS higher by about
    the model's bytes, measured); None: back to the kernel only when the model's bytes exceed
    a quarter of the host's available memory (`returns_freed`)."""

    def __post_init__(self) -> None:
        if not list(self.blocks):
            raise ValueError("Streaming.blocks is empty: name the blocks to stream")
        if isinstance(self.window_bytes, bool) or not isinstance(self.window_bytes, int) or self.window_bytes < 1:
            raise ValueError(f"Streaming.window_bytes must be an int >= 1, got {self.window_bytes!r}")
        if self.micro_batches not in (0, 1):
            raise ValueError(f"Streaming.micro_batches must be 0 (any) or 1, got {self.micro_batches!r}")
        if self.return_freed is not None and not isinstance(self.return_freed, bool):
            raise ValueError(f"Streaming.return_freed must be True, False or None (decide), got {self.return_freed!r}")

    def returns_freed(self, model_bytes: int, available: int | None) -> bool:
        """Whether freed host memory goes back to the kernel (`return_freed`), for a model of
        `model_bytes` (its parameters in the compute dtype) on a host with `available` bytes
        free (None: unknown). Kept in the heap, the trainer's peak RSS rose by 1.10-1.15x the
        model's bytes (zero_infinity's GPTs, docs/trainer.md), and a page fault (about 3 us on
        the 2-core bench host) was saved per 4 KiB of every such allocation: so the heap keeps
        them where that rise fits in a quarter of what the host has free."""
        if self.return_freed is not None:
            return self.return_freed
        return available is None or 4 * model_bytes > available


class StepLost(RuntimeError):
    """A daemon lost this step's accumulated parts (it restarted): run the step's micro-batches
    again and call step() again."""


class StepTorn(RuntimeError):
    """Some daemons applied a step and others could not (they lost its parts between the
    check and the APPLY): the model's shards are at different versions."""


def check_stage_streaming(stream: Streaming, config, daemons, offload, reduce_hook) -> None:
    """What a streamed PipelineTrainer stage (trainer/pipeline/trainer.py: its ParallelConfig, daemons,
    OffloadConfig and reduce_hook) does not do (yet), refused before anything is built."""
    if not isinstance(stream, Streaming):
        raise TypeError(f"stream must be a ps_offload.Streaming, got {type(stream).__name__}")
    if not daemons:
        raise ValueError("a streamed stage needs daemons: they hold its blocks between uses")
    if stream.micro_batches == 1:
        raise ValueError(
            "Streaming(micro_batches=1) is for offload(): a stage's micro-batches are ParallelConfig.microbatches"
        )
    refused = {
        "ParallelConfig.max_grad_norm": config.max_grad_norm is not None,
        "ParallelConfig.dp_compression": config.dp_compression.enabled,
        "reduce_hook": reduce_hook is not None,
        "OffloadConfig.staleness=1": bool(offload.staleness),
    }
    named = [name for name, given in refused.items() if given]
    if named:
        raise ValueError(f"a streamed stage does not support {', '.join(named)} yet: leave it out")
