"""Gradient push encodings (proto/ps.proto, `Encoding`): sizes, parsing and validation.

A push is checked twice. Before its payload is read, `check_size` compares the announced
byte count with what the encoding needs for the shard's n elements. Once the payload is in
its staging buffer, `parse` checks its content (TOPK's count, index range and order) and
returns views into the buffer: the fp32 gradient itself for RAW, else a compressed gradient
that `ShardStore.push` applies. Both raise InvalidArgument naming the shard and what was
expected; the store takes the shard's lock only after parsing, so bad input changes nothing.

The layouts themselves are the contract's: ps_offload.proto.payloads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ps_offload import kernels
from ps_offload.daemon.errors import InvalidArgument
from ps_offload.kernels import fused_step
from ps_offload.proto import payloads

ENCODINGS = ("raw", "onebit", "bf16", "fp16", "topk")
# Held around every Numba kernel the daemon runs (decompression, the fused 1-bit AdamW): each
# call is parallel over all cores already, and Numba's workqueue threading layer (its fallback
# without OpenMP or TBB) aborts when two threads launch parallel kernels at once.
KERNEL_LOCK = threading.Lock()


@dataclass(frozen=True)
class OneBitGradient:
    scales: torch.Tensor  # float32[ceil(n / BLOCK)]
    bits: torch.Tensor  # uint8[ceil(n / 8)], LSB first; 1 = +scale
    numel: int

    def decompress(self, out: torch.Tensor) -> torch.Tensor:
        with KERNEL_LOCK:
            return kernels.onebit_decompress(self.bits, self.scales, self.numel, out=out)


@dataclass(frozen=True)
class CastGradient:
    values: torch.Tensor  # bfloat16 or float16 [n]

    @property
    def numel(self) -> int:
        return self.values.numel()

    def decompress(self, out: torch.Tensor) -> torch.Tensor:
        return kernels.cast_decompress(self.values, out=out)  # a torch copy, no Numba


@dataclass(frozen=True)
class TopKGradient:
    indices: torch.Tensor  # int32[K], shard-local, strictly ascending
    values: torch.Tensor  # float32[K]
    numel: int

    def decompress(self, out: torch.Tensor) -> torch.Tensor:
        with KERNEL_LOCK:
            return kernels.topk_decompress(self.indices, self.values, self.numel, out=out)


CompressedGradient = OneBitGradient | CastGradient | TopKGradient


def check_size(encoding: str, nbytes: int, numel: int, where: str) -> None:
    """Raises InvalidArgument unless `nbytes` is a valid payload size for `numel` elements.
    `where` names the push ("push to shard 3") for the message."""
    if encoding == "raw":
        expected, how = 4 * numel, f"{numel} float32 = {4 * numel} bytes"
    elif encoding == "onebit":
        expected = payloads.onebit_nbytes(numel)
        how = (
            f"ONEBIT: {payloads.blocks(numel)} float32 scales + {expected - payloads.onebit_sign_offset(numel)} "
            f"sign bytes = {expected} bytes "
            f"for its {numel} elements"
        )
    elif encoding in ("bf16", "fp16"):
        expected = payloads.half_nbytes(numel)
        how = f"{encoding.upper()}: {numel} 2-byte values = {expected} bytes"
    elif encoding == "topk":
        k = payloads.topk_count(nbytes)
        if k is None or k > numel:
            raise InvalidArgument(
                f"{where}: header says {nbytes} bytes, but TOPK needs 4 + 8 K bytes (a uint32 K, then K int32 "
                f"indices and K float32 values) with 1 <= K <= {numel}, the shard's numel"
            )
        return
    else:
        raise InvalidArgument(f"{where}: unknown encoding {encoding!r}; send one of {', '.join(ENCODINGS)}")
    if nbytes != expected:
        raise InvalidArgument(f"{where}: header says {nbytes} bytes, the shard needs {how}")


def parse(
    encoding: str, staging: torch.Tensor, nbytes: int, numel: int, where: str
) -> torch.Tensor | CompressedGradient:
    """The gradient in `staging` (an fp32 buffer whose first `nbytes` bytes hold the payload,
    already size-checked): the fp32 tensor for RAW, else views as a compressed gradient."""
    if encoding == "raw":
        return staging[:numel]
    raw = staging.view(torch.uint8)[:nbytes]
    if encoding == "onebit":
        signs = payloads.onebit_sign_offset(numel)
        return OneBitGradient(scales=raw[:signs].view(torch.float32), bits=raw[signs:], numel=numel)
    if encoding in ("bf16", "fp16"):
        return CastGradient(raw.view(torch.bfloat16 if encoding == "bf16" else torch.float16))
    if encoding == "topk":
        return _parse_topk(raw, numel, where)
    raise InvalidArgument(f"{where}: unknown encoding {encoding!r}")


def check_finite(data: torch.Tensor | CompressedGradient, where: str) -> None:
    """Raises InvalidArgument naming the first NaN or infinite value of a parsed payload: a RAW
    or BF16/FP16 element, a TOPK value, a ONEBIT block scale (a sign cannot be one). One read of
    those values as they came, by their exponent bits, on all cores (kernels/fused_step.py
    `all_finite`): a bf16 gradient's check reads 2 bytes an element, where the step moves 26."""
    if isinstance(data, OneBitGradient):
        values, what = data.scales, "block scale"
    elif isinstance(data, (TopKGradient, CastGradient)):
        values, what = data.values, "value" if isinstance(data, TopKGradient) else "element"
    else:
        values, what = data, "element"
    if fused_step.all_finite(values):
        return
    at = int((~torch.isfinite(values)).nonzero()[0])
    place = f"{what} {at}" + (f" (of element {int(data.indices[at])})" if isinstance(data, TopKGradient) else "")
    raise InvalidArgument(
        f"{where}: {place} is {float(values[at])}; nothing was applied. A non-finite value would make the "
        "shard's master values and optimizer state non-finite for good, for every trainer of the model: find "
        "where it comes from (a diverging loss; fp16 without a GradScaler), or let the daemon apply such pushes "
        "as torch would in process (store.allow_nonfinite_pushes = true)"
    )


def _parse_topk(raw: torch.Tensor, numel: int, where: str) -> TopKGradient:
    k = payloads.topk_count(raw.numel())  # size-checked already: not None
    count = payloads.TOPK_COUNT_BYTES
    said = int(raw[:count].view(torch.int32).item()) & 0xFFFFFFFF  # uint32 on the wire
    if said != k:
        raise InvalidArgument(f"{where}: TOPK payload says K = {said}, but its {raw.numel()} bytes hold K = {k}")
    indices = raw[count : payloads.topk_value_offset(k)].view(torch.int32)
    values = raw[payloads.topk_value_offset(k) :].view(torch.float32)
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= numel:
        bad = lo if lo < 0 else hi
        at = int((indices == bad).nonzero()[0])
        raise InvalidArgument(
            f"{where}: TOPK index {bad} (position {at}) is outside the shard's {numel} elements [0, {numel})"
        )
    if k > 1:
        steps = indices[1:] - indices[:-1]
        if int(steps.min()) <= 0:
            at = int((steps <= 0).nonzero()[0]) + 1
            raise InvalidArgument(
                f"{where}: TOPK indices must be strictly ascending (block-major, ascending within each block); "
                f"index {int(indices[at])} at position {at} follows {int(indices[at - 1])}"
            )
    return TopKGradient(indices=indices, values=values, numel=numel)
