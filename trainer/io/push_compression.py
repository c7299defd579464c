"""Compressed pushes with error feedback: the trainer's side of the ONEBIT, BF16, FP16 and TOPK
push encodings (ps_offload.proto.payloads gives their layouts).

Each shard's slice is compressed on its own, so blocks start at the shard's first element,
together with its slice of a persistent fp32 error buffer laid out as the flat gradients:
c = values + error is what gets compressed, and error keeps c - decompress(sent), so what one
step leaves out is sent by later ones (worker-side error feedback).

What is compressed: the gradient (GRADIENT pushes), except for "onebit" under AdamW, which
is 1-bit Adam (Tang et al., 2021): the trainer keeps AdamW's first moment m (fp32, the flat
gradients' layout) from step 0, m = lerp(m, g, 1 - beta1) on every step; after the warm-up it
compresses m, sends it as a MOMENTUM push, and replaces its own m with the decompressed
value, which is what the daemon stores as exp_avg. The daemon freezes exp_avg_sq where the
warm-up left it (variance_frozen_at = warmup_steps). Compressing the smooth momentum instead
of the noisy gradient, with the variance frozen, is what lets signs train as well as fp32:
compressing the gradient and updating v from it ended 40% above fp32's loss on the demo model
(docs/trainer.md, "1-bit Adam"). It costs 4 bytes per parameter more on the trainer.

Idempotency: a daemon applies a push at most once per (shard, step), and a step that failed
is sent again with the same step number. So the payload of (shard, step) is made once and
kept until the shard's next step is made: a resend carries the same bytes, and the error
buffer and the momentum are not updated twice for one step.

The first `warmup_steps` steps (counted from step 0, also after a resume) go uncompressed
(RAW gradients), as 1-bit Adam runs plain Adam first so that the second moment settles
before signs take over. The error buffer starts at zero when the optimizer is built (a
resumed trainer loses at most one step's residual); a resumed 1-bit Adam trainer pulls its
momentum from the daemons' exp_avg (OffloadOptimizer).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ps_offload import kernels
from ps_offload.proto import payloads, ps_pb2
from ps_offload.proto.plan import ShardSlice

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
    kind: int = ps_pb2.GRADIENT  # or ps_pb2.MOMENTUM (1-bit Adam)
    variance_frozen_at: int | None = None  # MOMENTUM pushes: the warm-up steps


def check_compression(compression: str, warmup_steps: int, topk_ratio: float, *, adam: bool = False) -> None:
    """Raises ValueError for options the compressor cannot honour. `adam`: the optimizer is
    AdamW, where "onebit" means 1-bit Adam and needs warm-up steps to estimate the variance."""
    if compression not in ENCODINGS:
        raise ValueError(f"compression must be one of {', '.join(map(repr, ENCODINGS))}, got {compression!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float)) or not 0 < topk_ratio <= 1:
        raise ValueError(f"topk_ratio must be a number with 0 < topk_ratio <= 1, got {topk_ratio!r}")
    if adam and compression == "onebit" and warmup_steps < 1:
        raise ValueError(
            "CompressionConfig(method='onebit') under AdamW is 1-bit Adam: it freezes the second moment after "
            "the uncompressed warm-up, so it needs CompressionConfig.warmup_steps >= 1 (1-bit Adam uses 15-25% "
            "of the run)"
        )


class PushCompressor:
    """The payloads of one optimizer's pushes, its error-feedback buffer and (1-bit Adam) its
    momentum.

    Invariants: `error` and `momentum` have the flat gradients' layout (None when unused); a
    shard's payload of a given step is made at most once, from the error and momentum slices
    as the previous steps left them; that payload is kept until the same shard's next step is
    made. Different shards may be made from different threads at once (their slices are
    disjoint); one shard is never asked for from two threads at once (a step's tasks finish
    before it is submitted again)."""

    def __init__(
        self,
        compression: str,
        numel: int,
        *,
        warmup_steps: int = 0,
        topk_ratio: float = 0.01,
        adam_beta1: float | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """`adam_beta1`: AdamW's beta1 when the optimizer is AdamW (None otherwise); `device`:
        the gradients' (the kernels run there: Numba CUDA on a GPU, so only the compressed
        bytes cross to the host; the error and momentum live there too)."""
        check_compression(compression, warmup_steps, topk_ratio, adam=adam_beta1 is not None)
        self.compression = compression
        self.warmup_steps = warmup_steps
        self.topk_ratio = float(topk_ratio)
        fp32 = {"dtype": torch.float32, "device": device}
        self.error = torch.zeros(numel, **fp32) if compression != "none" else None
        self.beta1 = adam_beta1
        one_bit_adam = compression == "onebit" and adam_beta1 is not None
        self.momentum = torch.zeros(numel, **fp32) if one_bit_adam else None
        self._kept: dict[int, tuple[int, Payload]] = {}
        # Numba's parallel kernels already use every core, and its workqueue threading layer
        # (the fallback without OpenMP or TBB) aborts on concurrent launches: one at a time.
        self._kernel_lock = threading.Lock()

    def compresses(self, step: int) -> bool:
        return self.compression != "none" and step >= self.warmup_steps

    def payload(self, shard: ShardSlice, step: int, grads: torch.Tensor) -> Payload | None:
        """The push of `shard` at `step`, from `grads` (the flat gradient buffer, in the
        compute dtype on its device); None: send the gradient as it is (a warm-up step).
        Its device work (the kernels, the error and momentum updates, the copy of the bytes
        to the host) runs on the calling thread's current stream: on an accelerator, call it
        inside `ShardMover.following(after)`, as ShardIO does, so that it follows the compute
        stream's writes of `grads` and is complete when the bytes are read."""
        grad = grads[shard.offset : shard.end]
        if self.momentum is None and not self.compresses(step):
            return None
        kept = self._kept.get(shard.shard_id)
        if kept is not None and kept[0] == step:
            return kept[1]
        if grad.dtype != torch.float32:
            grad = grad.float()  # exact; the kernels and the error feedback work in fp32
        if self.momentum is not None:
            payload = self._one_bit_adam(grad, shard, step)
        else:
            with self._kernel_lock:
                payload = self._compress(grad, self.error[shard.offset : shard.end])
        self._kept[shard.shard_id] = (step, payload)
        return payload

    def _one_bit_adam(self, grad: torch.Tensor, shard: ShardSlice, step: int) -> Payload:
        momentum = self.momentum[shard.offset : shard.end]
        momentum.lerp_(grad, 1 - self.beta1)  # AdamW's first moment, as the daemon computes it
        if not self.compresses(step):
            return None  # warm-up: the gradient as it is, the daemon runs AdamW on g
        with self._kernel_lock:
            bits, scales = kernels.onebit_compress(momentum, self.error[shard.offset : shard.end])
            kernels.onebit_decompress(bits, scales, momentum.numel(), out=momentum)  # = the daemon's exp_avg
        return Payload(
            ps_pb2.ONEBIT,
            _bytes(_onebit_wire(bits, scales)),
            kind=ps_pb2.MOMENTUM,
            variance_frozen_at=self.warmup_steps,
        )

    def _compress(self, grad: torch.Tensor, error: torch.Tensor) -> Payload:
        encoding = ENCODINGS[self.compression]
        if self.compression == "onebit":
            bits, scales = kernels.onebit_compress(grad, error)
            out = _onebit_wire(bits, scales)
        elif self.compression in _CAST:
            out = kernels.cast_compress(grad, error, _CAST[self.compression]).view(torch.uint8)
        else:
            indices, values = kernels.topk_compress(grad, error, self.topk_ratio)
            k, count, at_values = (
                indices.numel(),
                payloads.TOPK_COUNT_BYTES,
                payloads.topk_value_offset(indices.numel()),
            )
            out = torch.empty(payloads.topk_nbytes(k), dtype=torch.uint8)
            out[:count].view(torch.int32).fill_(k)  # K < 2**31: the uint32's bytes
            out[count:at_values].view(torch.int32).copy_(indices)
            out[at_values:].view(torch.float32).copy_(values)
        return Payload(encoding, _bytes(out))


def _onebit_wire(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """ONEBIT's layout (ps_offload.proto.payloads): the scales, then the sign bytes."""
    signs = 4 * scales.numel()  # payloads.onebit_sign_offset of the shard's numel
    out = torch.empty(signs + bits.numel(), dtype=torch.uint8)
    out[:signs].view(torch.float32).copy_(scales)
    out[signs:].copy_(bits)
    return out


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a payload, on the host (a GPU's compressed bytes cross here, not before)."""
    return memoryview(tensor.cpu().numpy()).cast("B")
