"""The byte layouts of compressed push payloads (proto/ps.proto, `Encoding`), for the trainer
that assembles them and the daemon that checks and parses them.

n is the shard's numel; blocks of BLOCK elements start at the shard's first element.
- RAW: 4n bytes, n float32.
- ONEBIT: ceil(n/BLOCK) float32 scales (one per block, the mean magnitude), then ceil(n/8)
  sign bytes, least significant bit first, 1 = +scale.
- BF16 / FP16: 2n bytes, n 2-byte values.
- TOPK: a uint32 K (1 <= K <= n), then K int32 shard-local indices, strictly ascending
  (block-major, ascending within a block), then K float32 values.

The compression kernels (ps_offload.kernels) keep their own BLOCK, as they import nothing of
ours; tests/ps_proto/test_payloads.py holds the two equal.
"""

from __future__ import annotations

BLOCK = 1024
"""Elements per ONEBIT scale and per TOPK selection block."""

TOPK_COUNT_BYTES = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks(numel: int) -> int:
    return _cdiv(numel, BLOCK)


def onebit_sign_offset(numel: int) -> int:
    """Where ONEBIT's sign bytes start: after one float32 scale per block."""
    return 4 * blocks(numel)


def onebit_nbytes(numel: int) -> int:
    return onebit_sign_offset(numel) + _cdiv(numel, 8)


def half_nbytes(numel: int) -> int:
    """BF16 and FP16."""
    return 2 * numel


def topk_nbytes(k: int) -> int:
    return TOPK_COUNT_BYTES + 8 * k


def topk_value_offset(k: int) -> int:
    """Where TOPK's float32 values start (its int32 indices start at TOPK_COUNT_BYTES)."""
    return TOPK_COUNT_BYTES + 4 * k


def topk_count(nbytes: int) -> int | None:
    """K for a TOPK payload of `nbytes`, or None when no K >= 1 gives that size."""
    k, rest = divmod(nbytes - TOPK_COUNT_BYTES, 8)
    return k if k >= 1 and rest == 0 else None
