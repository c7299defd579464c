"""The plain torch oracle for every kernel: written to be obviously right, not fast.

Inputs are assumed valid (kernels/__init__.py checks them). Works on any device.
"""

from __future__ import annotations

import torch

from ps_offload.kernels import BLOCK, LANES, ROWS, _topk_plan


def _c(grad: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
    """The value to compress: grad + error in fp32 (one rounding), or grad itself."""
    return grad.clone() if error is None else grad + error


def _block_lengths(n: int, device: torch.device) -> torch.Tensor:
    """int64[blocks]: BLOCK for every block but the last, which holds the rest."""
    blocks = -(-n // BLOCK)
    lengths = torch.full((blocks,), BLOCK, dtype=torch.int64, device=device)
    lengths[-1] = n - (blocks - 1) * BLOCK
    return lengths


def onebit_compress(grad: torch.Tensor, error: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    c = _c(grad, error)
    n = c.numel()
    lengths = _block_lengths(n, c.device)
    blocks = lengths.numel()

    # scale = mean |c| per block, summed in float64 in the one order every backend uses:
    # element r*LANES + t of a block goes to lane t, lanes add their ROWS elements in order r,
    # then lane t += lane t+s for s = LANES/2 .. 1. Absent elements of the last block are
    # +0.0, which changes no sum.
    magnitude = torch.zeros(blocks * BLOCK, dtype=torch.float64, device=c.device)
    magnitude[:n] = c.abs().double()
    rows = magnitude.view(blocks, ROWS, LANES)
    lanes = rows[:, 0]
    for r in range(1, ROWS):
        lanes = lanes + rows[:, r]
    s = LANES // 2
    while s:
        lanes = lanes[:, :s] + lanes[:, s : 2 * s]
        s //= 2
    scales = (lanes[:, 0] / lengths.double()).float()

    positive = c >= 0  # -0.0 counts as positive; NaN as negative
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.bool, device=c.device)
    padded[:n] = positive
    weights = 2 ** torch.arange(8, dtype=torch.int32, device=c.device)  # bit j = element 8*i + j
    bits = (padded.view(-1, 8).int() * weights).sum(dim=1).to(torch.uint8)

    if error is not None:
        scale = scales.repeat_interleave(lengths)
        error.copy_(c - torch.where(positive, scale, -scale))
    return bits, scales


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.int32, device=bits.device)
    positive = ((bits.int().unsqueeze(1) >> shifts) & 1).view(-1)[:n].bool()
    scale = scales.repeat_interleave(_block_lengths(n, bits.device))
    return torch.where(positive, scale, -scale)


def cast_compress(grad: torch.Tensor, error: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    c = _c(grad, error)
    values = c.to(dtype)
    if error is not None:
        error.copy_(c - values.float())
    return values


def topk_compress(grad: torch.Tensor, error: torch.Tensor | None, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    c = _c(grad, error)
    n = c.numel()
    k_full, k_last, blocks = _topk_plan(n, ratio)
    # |c| ordered by its bits (the same order as the magnitudes; NaN above infinity)
    key = c.view(torch.int32) & 0x7FFFFFFF
    kept = []
    last = (blocks - 1) * BLOCK
    for start, stop, k in [(0, last, k_full), (last, n, k_last)]:  # the full blocks, then the last one
        if start == stop:
            continue
        rows = key[start:stop].view(-1, min(BLOCK, stop - start))
        # stable: among equal |c| the lower index comes first
        order = torch.sort(rows, dim=1, descending=True, stable=True).indices[:, :k]
        first = start + BLOCK * torch.arange(rows.shape[0], device=c.device).unsqueeze(1)
        kept.append((order.sort(dim=1).values + first).view(-1))
    indices = torch.cat(kept)
    values = c[indices]
    if error is not None:
        error.copy_(c)
        error[indices] = 0.0
    return indices.to(torch.int32), values


def topk_decompress(indices: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float32, device=values.device)
    out[indices.long()] = values
    return out
