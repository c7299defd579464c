"""Compressed gradient pushes with error feedback: the trainer's side of the ONEBIT, BF16, FP16
and TOPK push encodings (proto/ps.proto gives their layouts).

Each shard's gradient slice is compressed on its own, so blocks start at the shard's first
element, together with its slice of a persistent fp32 error buffer laid out as the flat
gradients: c = grad + error is what gets compressed, and error keeps c - decompress(sent), so
what one step leaves out is sent by later ones (worker-side error feedback, as in 1-bit Adam).

Idempotency: a daemon applies a push at most once per (shard, step), and a step that failed
is sent again with the same step number. So the payload of (shard, step) is made once and
kept until the shard's next step is compressed: a resend carries the same bytes, and the
error buffer is not updated twice for one step.

The first `warmup_steps` steps (counted from step 0, also after a resume) go uncompressed
(RAW), as 1-bit Adam runs plain Adam first so that the second moment settles before signs
take over. The error buffer starts at zero when the optimizer is built (a resumed trainer
loses at most one step's residual).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

import kernels
from ps_daemon.plan import ShardSlice
from ps_proto import ps_pb2

ENCODINGS = {
    "none": ps_pb2.RAW,
    "bf16": ps_pb2.BF16,
    "fp16": ps_pb2.FP16,
    "onebit": ps_pb2.ONEBIT,
    "topk": ps_pb2.TOPK,
}
_CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Payload:
    encoding: int  # a ps_pb2.Encoding value
    data: memoryview  # the push's bytes, as the encoding lays them out


def check_compression(compression: str, warmup_steps: int, topk_ratio: float) -> None:
    """Raises ValueError for options the compressor cannot honour."""
    if compression not in ENCODINGS:
        raise ValueError(f"compression must be one of {', '.join(map(repr, ENCODINGS))}, got {compression!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"compression_warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float)) or not 0 < topk_ratio <= 1:
        raise ValueError(f"topk_ratio must be a number with 0 < topk_ratio <= 1, got {topk_ratio!r}")


class PushCompressor:
    """The payloads of one optimizer's gradient pushes, and its error-feedback buffer.

    Invariants: `error` has the flat gradients' layout (None without compression); a shard's
    gradient of a given step is compressed at most once, with the error slice as the previous
    steps left it; that payload is kept until the same shard's next step is compressed.
    Different shards may be compressed from different threads at once (their slices are
    disjoint); one shard is never asked for from two threads at once (a step's tasks finish
    before it is submitted again)."""

    def __init__(self, compression: str, numel: int, *, warmup_steps: int = 0, topk_ratio: float = 0.01) -> None:
        check_compression(compression, warmup_steps, topk_ratio)
        self.compression = compression
        self.warmup_steps = warmup_steps
        self.topk_ratio = float(topk_ratio)
        self.error = torch.zeros(numel, dtype=torch.float32) if compression != "none" else None
        self._kept: dict[int, tuple[int, Payload]] = {}
        # Numba's parallel kernels already use every core, and its workqueue threading layer
        # (the fallback without OpenMP or TBB) aborts on concurrent launches: one at a time.
        self._kernel_lock = threading.Lock()

    def compresses(self, step: int) -> bool:
        return self.compression != "none" and step >= self.warmup_steps

    def payload(self, shard: ShardSlice, step: int, grads: torch.Tensor) -> Payload:
        """The push of `shard` at `step`, from `grads` (the flat fp32 gradient buffer)."""
        grad = grads[shard.offset : shard.end]
        if not self.compresses(step):
            return Payload(ps_pb2.RAW, _bytes(grad))  # the gradient buffer itself, no copy
        kept = self._kept.get(shard.shard_id)
        if kept is not None and kept[0] == step:
            return kept[1]
        with self._kernel_lock:
            payload = self._compress(grad, self.error[shard.offset : shard.end])
        self._kept[shard.shard_id] = (step, payload)
        return payload

    def _compress(self, grad: torch.Tensor, error: torch.Tensor) -> Payload:
        encoding = ENCODINGS[self.compression]
        if self.compression == "onebit":
            bits, scales = kernels.onebit_compress(grad, error)
            out = torch.empty(4 * scales.numel() + bits.numel(), dtype=torch.uint8)
            out[: 4 * scales.numel()].view(torch.float32).copy_(scales)
            out[4 * scales.numel() :].copy_(bits)
        elif self.compression in _CAST:
            out = kernels.cast_compress(grad, error, _CAST[self.compression]).view(torch.uint8)
        else:
            indices, values = kernels.topk_compress(grad, error, self.topk_ratio)
            k = indices.numel()
            out = torch.empty(4 + 8 * k, dtype=torch.uint8)
            out[:4].view(torch.int32).fill_(k)  # K < 2**31: the uint32's bytes
            out[4 : 4 + 4 * k].view(torch.int32).copy_(indices)
            out[4 + 4 * k :].view(torch.float32).copy_(values)
        return Payload(encoding, _bytes(out))


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")
