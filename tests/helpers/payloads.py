"""Push payloads as a trainer would send them: a tensor's memory as bytes (pulls land in it
too), and the compressed encodings' bytes (bf16, fp16, top-k, 1-bit) built with the kernels."""

from __future__ import annotations

import torch

from ps_offload import kernels


def tensor_bytes(values: torch.Tensor) -> memoryview:
    """An fp32 (or other numpy-typed) tensor's own memory, as bytes: writable, so a pull
    into it fills the tensor."""
    return memoryview(values.numpy()).cast("B")


def byte_view(t: torch.Tensor) -> memoryview:
    """Any dtype's tensor as bytes (through a uint8 view: bf16 too); a copy if it is not
    contiguous."""
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def onebit_payload(n: int) -> torch.Tensor:
    """A valid 1-bit payload for a shard of `n` elements (scales, then sign bits)."""
    bits, scales = kernels.onebit_compress(torch.linspace(-1, 1, n), None)
    return torch.cat([scales.view(torch.uint8), bits])


def encoded_payload(encoding: str, grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The bytes a trainer would send, in an fp32 staging buffer as the daemon receives them,
    and how many of them there are."""
    if encoding == "onebit":
        bits, scales = kernels.onebit_compress(grad, None)
        raw = torch.cat([scales.view(torch.uint8), bits])
    elif encoding in ("bf16", "fp16"):
        raw = kernels.cast_compress(grad, None, torch.bfloat16 if encoding == "bf16" else torch.float16)
        raw = raw.view(torch.uint8)
    else:
        indices, values = kernels.topk_compress(grad, None, 0.05)
        raw = torch.cat([torch.tensor([indices.numel()], dtype=torch.int32).view(torch.uint8),
                         indices.view(torch.uint8), values.view(torch.uint8)])  # fmt: skip
    staging = torch.zeros((raw.numel() + 3) // 4)
    staging.view(torch.uint8)[: raw.numel()] = raw
    return staging, raw.numel()
