"""One push: the request that carries a gradient, a momentum or initial values from the wire
(ps_daemon.wire builds it from a PushHeader) to the optimizer, and its validation.

A push is checked completely before anything changes. Building a PushRequest checks what
it says on its own (kind, dtype, step, lr, variance_frozen_at against the kind); `check_shard`
what depends on the shard it names (size, optimizer); the store then checks the step against
the shard's version under the shard's lock (`check_step_locked`), and only then applies it.
The numeric bounds are ps_daemon.spec's (its docstring says why MAX_LR).
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import torch

from ps_offload.daemon.encodings import CompressedGradient, OneBitGradient, TopKGradient, check_size
from ps_offload.daemon.errors import FailedPrecondition, InvalidArgument
from ps_offload.daemon.optim import AdamWConfig
from ps_offload.daemon.spec import MAX_LR, check_number

if TYPE_CHECKING:
    from ps_offload.daemon.shard import Shard

KINDS = ("gradient", "parameters", "momentum")


@dataclass(frozen=True)
class PushRequest:
    """A push to one shard. Before its payload arrives `data` is None and `nbytes` is the
    size its header announced; once parsed, `data` holds it (fp32 with the shard's numel,
    or compressed: ps_daemon.encodings) and `nbytes` may be left None."""

    model: str
    shard_id: int
    _: KW_ONLY
    step: int
    kind: str  # one of KINDS
    encoding: str = "raw"  # one of encodings.ENCODINGS; checked with the size (check_shard)
    dtype: str = "float32"
    nbytes: int | None = None
    lr: float | None = None  # None: the registered one
    variance_frozen_at: int | None = None  # MOMENTUM only: updates after which exp_avg_sq froze
    data: torch.Tensor | CompressedGradient | None = None

    def __post_init__(self) -> None:
        where = self.where
        if self.kind not in KINDS:
            raise InvalidArgument(f"{where}: kind {self.kind!r} is unknown; one of {', '.join(KINDS)}")
        if not self.step >= 0:
            raise InvalidArgument(f"{where}: step must be >= 0, got {self.step}")
        if self.dtype != "float32":
            raise InvalidArgument(
                f"{where}: dtype {self.dtype} is not accepted; send float32 (a gradient may travel as "
                "bf16 or fp16 with encoding BF16 or FP16)"
            )
        if self.kind == "parameters" and self.encoding != "raw":
            raise InvalidArgument(
                f"{where}: initial PARAMETERS must be RAW float32 (they are the master values), "
                f"got encoding {self.encoding.upper()}; only gradients may be compressed"
            )
        if self.kind == "parameters" and self.compressed:
            raise InvalidArgument(f"{where}: initial parameters must be RAW float32")
        if self.lr is not None:
            problem = check_number(self.lr, "lr", low=0.0, high=MAX_LR)
            if problem:
                raise InvalidArgument(f"{where}: {problem}")
        if self.kind != "momentum" and self.variance_frozen_at is not None:
            raise InvalidArgument(
                f"{where}: variance_frozen_at is for MOMENTUM pushes only, this is {self.kind.upper()}"
            )

    @property
    def where(self) -> str:
        return f"push to shard {self.shard_id}"

    @property
    def compressed(self) -> bool:
        return self.data is not None and not isinstance(self.data, torch.Tensor)

    def with_data(self, data: torch.Tensor | CompressedGradient) -> PushRequest:
        """The same push once its payload is parsed."""
        return dataclasses.replace(self, data=data)

    def check_shard(self, shard: Shard) -> None:
        """Raises unless this push fits `shard`: its size (the announced one, or the data's),
        and for a MOMENTUM push an AdamW shard and a variance frozen after 1..step updates."""
        where, numel, data = self.where, shard.slice.numel, self.data
        if self.kind == "momentum":
            if not isinstance(shard.optimizer.config, AdamWConfig):
                raise FailedPrecondition(
                    f"{where}: MOMENTUM pushes are 1-bit Adam's compression stage and need an AdamW model; "
                    f"model {shard.model!r} runs {type(shard.optimizer.config).__name__} (push gradients instead)"
                )
            frozen = self.variance_frozen_at
            if frozen is None or not 1 <= frozen <= self.step:
                raise InvalidArgument(
                    f"{where}: a MOMENTUM push for step {self.step} needs variance_frozen_at in [1, {self.step}] "
                    f"(the uncompressed warm-up steps after which exp_avg_sq stopped), got {frozen}"
                )
        if data is None:
            check_size(self.encoding, self.nbytes or 0, numel, where)
        elif self.compressed:
            if data.numel != numel:
                raise InvalidArgument(f"{where}: got {data.numel} elements, expected {numel}")
        elif data.dtype != torch.float32 or data.numel() != numel:
            raise InvalidArgument(f"{where}: got {data.numel()} {data.dtype}, expected {numel} float32")

    @property
    def payload_bytes(self) -> int:
        """Bytes the push carried on the wire."""
        data = self.data
        if data is None:
            return self.nbytes or 0
        if isinstance(data, torch.Tensor):
            return data.numel() * data.element_size()
        if isinstance(data, OneBitGradient):
            return data.scales.numel() * 4 + data.bits.numel()
        if isinstance(data, TopKGradient):
            return 4 + 8 * data.indices.numel()
        return data.values.numel() * data.values.element_size()


@dataclass(frozen=True)
class PushResult:
    applied: bool
    version: int


def check_step_locked(shard: Shard, push: PushRequest) -> PushResult | None:
    """Under shard.cond: the acknowledgement of a push applied before, None for one to apply
    now; raises for one that cannot be applied yet (or any more)."""
    sid, step = shard.slice.shard_id, push.step
    if push.kind == "parameters":
        if shard.version > 0:
            raise FailedPrecondition(
                f"shard {sid} has had {shard.version} updates; initial values can only be "
                "pushed before the first update"
            )
        return None
    if not shard.initialized:
        raise FailedPrecondition(f"shard {sid} has no values yet: push its initial parameters before gradients")
    if step < shard.version:
        return PushResult(applied=False, version=shard.version)
    if step > shard.version:
        raise FailedPrecondition(
            f"push for step {step} to shard {sid}, which is at version {shard.version}: "
            f"step {shard.version} must be applied first"
        )
    return None
