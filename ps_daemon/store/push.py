"""One push: the request that carries a gradient (whole, or a part of one, or the APPLY of
the parts: ps_offload.daemon.store.accumulate), a momentum or initial values from the wire
(ps_offload.daemon.rpc.conversions builds it from a PushHeader) to the optimizer, and its
validation.

A push is checked completely before anything changes. Building a PushRequest checks what
it says on its own (kind, dtype, step, lr, variance_frozen_at, groups, grad_multiplier, part
and parts against the kind, a part's encoding, APPLY's empty payload, each group's lr and
weight decay); `check_shard` what depends on the shard
it names (size, optimizer, the number of param groups and the settings its optimizer reads);
the store then checks the step against the shard's version under the shard's lock
(`check_step_locked`; a part's place and APPLY's count: ps_offload.daemon.store.accumulate), and only
then applies it. The numeric bounds are ps_offload.daemon.model.spec's (its
docstring says why MAX_LR).

Param groups (GRADIENT and APPLY pushes only; a MOMENTUM push's fused 1-bit Adam kernel takes one lr
and one pair of betas, so it keeps the header's lr): every group's settings, with the header's
lr unset. AdamW's betas in [0, 1) and eps finite and > 0 (torch allows eps 0; with a zero
second moment that step is 0 / 0). SGD's momentum is nonzero exactly when the registered one
is: the daemon keeps a momentum buffer only then, from the shard's first update, and torch's
fused SGD starts a buffer (its "first step") the first time a group's momentum is nonzero; a
zero where the buffer exists, or the reverse, would part from torch.optim.SGD. Nesterov (a
registered setting) needs dampening 0, as torch requires.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Protocol

import torch

from ps_offload.daemon.errors import FailedPrecondition, InvalidArgument
from ps_offload.daemon.model.encodings import (
    CastGradient,
    CompressedGradient,
    OneBitGradient,
    TopKGradient,
    check_size,
)
from ps_offload.daemon.model.optimizer import ShardOptimizer, state_tensors
from ps_offload.daemon.model.spec import MAX_LR, MAX_WEIGHT_DECAY, check_number
from ps_offload.optimizers import GroupSettings
from ps_offload.proto.plan import ShardSlice


class Shard(Protocol):
    """What a push is checked against (ps_offload.daemon.store.shard.Shard)."""

    model: str
    version: int
    initialized: bool
    cond: threading.Condition
    slice: ShardSlice
    optimizer: ShardOptimizer


KINDS = ("gradient", "parameters", "momentum", "gradient_part", "apply", "state")
# A part is added to an fp32 sum: it travels as values (RAW) or as halves widened exactly. The
# compressed encodings are for whole gradients (their error feedback is the trainer's, per push).
PART_ENCODINGS = ("raw", "bf16", "fp16")
# What steps the optimizer with the gradient's settings (groups, grad_multiplier).
STEPPING_GRADIENT = ("gradient", "apply")


@dataclass(frozen=True)
class PushRequest:
    """A push to one shard. Before its payload arrives `data` is None and `nbytes` is the
    size its header announced; once parsed, `data` holds it (fp32 with the shard's numel,
    or compressed: ps_offload.daemon.model.encodings) and `nbytes` may be left None."""

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
    groups: tuple[GroupSettings, ...] = ()  # GRADIENT and APPLY only: each param group's settings
    grad_multiplier: float | None = None  # GRADIENT and APPLY only: times the decoded fp32 gradient
    part: int = 0  # GRADIENT_PART only: which part of the step's gradient, from 0
    parts: int = 0  # APPLY only: how many parts the step's gradient has (>= 1)
    check_only: bool = False  # APPLY only: check the parts held, apply nothing
    speculate: bool = False  # GRADIENT_PART part 0 only: may be applied at once (ps_offload.daemon.store.speculation)
    lost_holders: tuple[int, ...] = ()  # a replicated model's daemons its trainer left out (replica_reports)
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
        what = {"parameters": "initial PARAMETERS", "state": "a STATE"}.get(self.kind)
        if what and self.encoding != "raw":
            raise InvalidArgument(
                f"{where}: {what} must be RAW float32 (master values and optimizer state are kept exactly), "
                f"got encoding {self.encoding.upper()}; only gradients may be compressed"
            )
        if what and self.compressed:
            raise InvalidArgument(f"{where}: {what} must be RAW float32")
        if self.lr is not None:
            problem = check_number(self.lr, "lr", low=0.0, high=MAX_LR)
            if problem:
                raise InvalidArgument(f"{where}: {problem}")
        if self.kind != "momentum" and self.variance_frozen_at is not None:
            raise InvalidArgument(
                f"{where}: variance_frozen_at is for MOMENTUM pushes only, this is {self.kind.upper()}"
            )
        self._check_parts()
        self._check_gradient_fields()

    def _check_parts(self) -> None:
        """part and parts against the kind; a part's encoding and lr, APPLY's empty payload."""
        where, kind = self.where, self.kind.upper()
        if self.kind != "gradient_part" and self.part:
            raise InvalidArgument(f"{where}: part is for GRADIENT_PART pushes only, this is {kind}")
        if self.kind != "apply" and self.parts:
            raise InvalidArgument(f"{where}: parts is for APPLY pushes only, this is {kind}")
        if self.kind != "apply" and self.check_only:
            raise InvalidArgument(f"{where}: check_only is for APPLY pushes only, this is {kind}")
        if self.kind == "gradient_part":
            if self.encoding not in PART_ENCODINGS or isinstance(self.data, OneBitGradient | TopKGradient):
                raise InvalidArgument(
                    f"{where}: a GRADIENT_PART must be RAW, BF16 or FP16 (it is added to an fp32 sum), got encoding "
                    f"{self.encoding.upper()}; compressed encodings are for whole GRADIENT pushes"
                )
            if self.speculate and self.part:
                raise InvalidArgument(
                    f"{where}: speculate is for part 0 of a step (the whole gradient), got part {self.part}"
                )
            if self.lr is not None and not self.speculate:
                raise InvalidArgument(
                    f"{where}: lr is for the APPLY of a step pushed in parts, not its GRADIENT_PART "
                    "(unless the part is sent with speculate)"
                )
        elif self.speculate:
            raise InvalidArgument(f"{where}: speculate is for GRADIENT_PART pushes only, this is {kind}")
        if self.kind == "apply":
            if self.parts < 1:
                raise InvalidArgument(
                    f"{where}: APPLY needs parts >= 1 (how many parts step {self.step} has), got {self.parts}"
                )
            if self.nbytes or self.data is not None:
                raise InvalidArgument(
                    f"{where}: APPLY carries no payload (the parts held are its gradient), "
                    f"got {self.payload_bytes} bytes"
                )

    def _check_gradient_fields(self) -> None:
        """groups and grad_multiplier: on a GRADIENT or an APPLY only (or a speculative part, the
        settings its APPLY is expected to name), and what they say on their own."""
        where = self.where
        for name in ("groups", "grad_multiplier"):
            if self.kind not in STEPPING_GRADIENT and not self.speculate and getattr(self, name) not in ((), None):
                part = self.kind == "gradient_part"
                also = " not sent with speculate (its APPLY carries the step's settings)" if part else ""
                raise InvalidArgument(
                    f"{where}: {name} is for GRADIENT and APPLY pushes only, this is {self.kind.upper()}{also}"
                )
        if self.groups and self.lr is not None:
            raise InvalidArgument(
                f"{where}: lr must be unset when groups are given (each group carries its lr), got lr {self.lr:g}"
            )
        for index, group in enumerate(self.groups):
            for name, high in (("lr", MAX_LR), ("weight_decay", MAX_WEIGHT_DECAY)):
                problem = check_number(getattr(group, name), f"groups[{index}].{name}", low=0.0, high=high)
                if problem:
                    raise InvalidArgument(f"{where}: {problem}")
        multiplier = self.grad_multiplier
        if multiplier is not None:
            # It multiplies fp32 values as an fp32 number: 1e300 would be inf, 1e-50 zero.
            as_fp32 = float(torch.tensor(multiplier, dtype=torch.float32))
            if not (math.isfinite(as_fp32) and as_fp32 > 0):
                raise InvalidArgument(
                    f"{where}: grad_multiplier must be finite and > 0 as a float32 (it multiplies the fp32 "
                    f"gradient; fp16 loss scaling sends 1/scale), got {multiplier:g}"
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
            if not shard.optimizer.plugin.takes_momentum:
                raise FailedPrecondition(
                    f"{where}: MOMENTUM pushes are 1-bit Adam's compression stage and need an AdamW model; "
                    f"model {shard.model!r} runs {shard.optimizer.plugin.name} (push gradients instead)"
                )
            if shard.optimizer.state_dtype != torch.float32:
                raise FailedPrecondition(
                    f"{where}: MOMENTUM pushes (1-bit Adam) need float32 state; model {shard.model!r} keeps "
                    f"{shard.optimizer.state_dtype} state (push gradients, or register it with float32 state)"
                )
            frozen = self.variance_frozen_at
            if frozen is None or not 1 <= frozen <= self.step:
                raise InvalidArgument(
                    f"{where}: a MOMENTUM push for step {self.step} needs variance_frozen_at in [1, {self.step}] "
                    f"(the uncompressed warm-up steps after which exp_avg_sq stopped), got {frozen}"
                )
        if self.groups:
            _check_groups(self.groups, shard.optimizer, f"{where} of model {shard.model!r}")
        if self.kind == "apply":  # no payload (checked on building)
            return
        if self.kind == "state" and not shard.optimizer.plugin.per_element_state:
            raise FailedPrecondition(
                f"{where}: model {shard.model!r} runs {shard.optimizer.plugin.name}, whose state is factored (not one "
                "value per element): a STATE push cannot lay it out (restore a snapshot on the daemons that took it)"
            )
        numel = self.payload_numel(shard)
        if self.kind == "state":
            where += f" (a STATE: the master and {numel // shard.slice.numel - 1} optimizer state tensors)"
        if data is None:
            check_size(self.encoding, self.nbytes or 0, numel, where)
        elif self.compressed:
            if data.numel != numel:
                raise InvalidArgument(f"{where}: got {data.numel} elements, expected {numel}")
        elif data.dtype != torch.float32 or data.numel() != numel:
            raise InvalidArgument(f"{where}: got {data.numel()} {data.dtype}, expected {numel} float32")

    def payload_numel(self, shard: Shard) -> int:
        """fp32 values the payload holds: the shard's numel, times 1 + its optimizer's state
        tensors for a STATE push."""
        numel = shard.slice.numel
        return numel * (1 + state_tensors(shard.optimizer.config)) if self.kind == "state" else numel

    def check_state(self, shard: Shard) -> None:
        """A STATE push's values (after check_shard): a second moment (exp_avg_sq: AdamW's, LAMB's)
        must be >= 0 (its square root is taken), or the restored shard's next step would be NaN."""
        names = shard.optimizer.plugin.state_names(shard.optimizer.config)
        if self.kind != "state" or "exp_avg_sq" not in names:
            return
        numel, index = shard.slice.numel, 1 + names.index("exp_avg_sq")
        exp_avg_sq = self.data[index * numel : (index + 1) * numel]
        if not bool((exp_avg_sq >= 0).all()):
            raise InvalidArgument(
                f"{self.where}: the STATE's exp_avg_sq (its third {numel} values) has negative or NaN values; "
                "AdamW's second moment is >= 0"
            )

    def values(self, borrow: Callable[[], torch.Tensor]) -> torch.Tensor | OneBitGradient:
        """What the optimizer takes (after check_shard): a ONEBIT momentum as it is (its fused
        kernel reads the signs), else fp32 with the shard's numel. Compressed values are
        decompressed, and a gradient multiplied by grad_multiplier, into `borrow()` (an fp32
        buffer of at least that numel, this push's own), so the payload is never changed."""
        data = self.data
        if self.kind == "momentum" and isinstance(data, OneBitGradient):
            return data
        if not self.compressed and self.grad_multiplier is None:
            return data
        out = borrow()[: data.numel if self.compressed else data.numel()]
        if self.compressed:
            data = data.decompress(out)
        if self.grad_multiplier is not None:
            data = multiplied(data, self.grad_multiplier, out)
        return data

    def gradient(self, borrow: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float | None]:
        """A GRADIENT's values as the optimizer's one-pass step takes them (after check_shard):
        RAW fp32 and BF16 / FP16 halves as they came (widened in the step), other encodings
        decompressed into `borrow()`; and the grad multiplier, applied in the step."""
        data = self.data
        if isinstance(data, torch.Tensor):
            return data, self.grad_multiplier
        if isinstance(data, CastGradient):
            return data.values, self.grad_multiplier
        return data.decompress(borrow()[: data.numel]), self.grad_multiplier

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


def multiplied(grad: torch.Tensor, multiplier: float, out: torch.Tensor) -> torch.Tensor:
    """`grad` times grad_multiplier into `out`, as torch.amp.GradScaler's unscale_: the fp32
    gradient times an fp32 scalar."""
    return torch.mul(grad, torch.tensor(multiplier, dtype=torch.float32), out=out)


def _check_groups(groups: tuple[GroupSettings, ...], optimizer: ShardOptimizer, where: str) -> None:
    """Raises unless `groups` holds every param group of the model, each with settings its
    optimizer may take (the module docstring; lr and weight decay are checked on building)."""
    count, config = optimizer.group_count, optimizer.config
    if len(groups) != count:
        raise InvalidArgument(
            f"{where}: groups has {len(groups)} entries, the model has {count} param groups "
            f"(ParamSpec.group 0..{count - 1}); send every group's settings"
        )
    for index, group in enumerate(groups):
        unknown = sorted(set(dict(group.extra)) - set(optimizer.plugin.extra_fields))
        if unknown:
            known = ", ".join(optimizer.plugin.extra_fields) or "none"
            raise InvalidArgument(
                f"{where}: groups[{index}].settings has {unknown[0]!r}, which {optimizer.plugin.name} does not read "
                f"(it reads {known})"
            )
        problem = optimizer.plugin.check_group(config, group, f"groups[{index}]")
        if problem:
            raise InvalidArgument(f"{where}: {problem}")


@dataclass(frozen=True)
class PushResult:
    applied: bool
    version: int
    pulled: bool = False  # the new version is in the place the push named too (ShardStore.push's pull_into)


@dataclass(frozen=True)
class CheckedPush:
    """A push checked against its shard once (ShardStore.check_push): the shard it names
    travels with it to ShardStore.push, which neither looks it up nor checks it again. The
    step is still checked there, under the shard's lock (a retry may race the first try)."""

    push: PushRequest
    shard: Shard
    duplicate: PushResult | None = None  # the acknowledgement of a push applied before: nothing to do

    def with_data(self, data: torch.Tensor | CompressedGradient) -> CheckedPush:
        """The same push once its payload is parsed (the parse gives the size checked)."""
        return dataclasses.replace(self, push=self.push.with_data(data))


def check_step_locked(shard: Shard, push: PushRequest) -> PushResult | None:
    """Under shard.cond: the acknowledgement of a push applied before, None for one to apply
    now; raises for one that cannot be applied yet (or any more)."""
    sid, step = shard.slice.shard_id, push.step
    if push.kind == "state":
        if shard.initialized and shard.version == step and step > 0:
            return PushResult(applied=False, version=shard.version)  # a retry of this state
        if shard.version > 0:
            raise FailedPrecondition(
                f"shard {sid} has had {shard.version} updates; a STATE (a restore) can only be pushed to a shard "
                "with none: register the model afresh to restore it"
            )
        return None
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
