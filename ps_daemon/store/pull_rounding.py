"""Pulls in bfloat16 or float16 (PullRequest.dtype): the master values rounded on the daemon,
so a GPU trainer that computes in that dtype moves half the bytes.

The rounding is torch's own cast (`Tensor.copy_` across dtypes, what `Tensor.to(dtype)` runs):
nearest, ties to even, fp16 overflow to inf, NaN kept. The trainer gets exactly the values it
would have got by pulling fp32 and casting them itself.

Only the master values travel narrow. The optimizer state is pulled to resume from, and a
rounded exp_avg or exp_avg_sq would change every step after the resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ps_offload.daemon.errors import InvalidArgument

PULL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a pull may travel in, by the store's names (float32: the values as stored)."""


def check_pull_dtype(dtype: str, tensor: str, where: str, stored: str = "float32") -> None:
    """Raises InvalidArgument unless `tensor` (one of ps_offload.daemon.store.shard.SHARD_TENSORS) may be
    pulled in `dtype` from a shard whose state is `stored` (ModelSpec.state_dtype); `where`
    names the pull ("pull of shard 3 of model 'm'"). State travels exactly: as float32 (widened
    from bf16 state), or as stored."""
    if dtype not in PULL_DTYPES:
        raise InvalidArgument(f"{where}: dtype {dtype!r} is unknown; one of {', '.join(PULL_DTYPES)}")
    if dtype not in ("float32", stored) and tensor != "master":
        raise InvalidArgument(
            f"{where}: dtype {dtype} is for master pulls only; pull {tensor} as float32 (dtype FLOAT32 or unset)"
        )


def element_bytes(dtype: str) -> int:
    return PULL_DTYPES[dtype].itemsize


def scratch_numel(numel: int, dtype: str) -> int:
    """fp32 elements of a staging buffer (ps_offload.daemon.rpc.staging.StagingPool) that holds `numel`
    values of `dtype`."""
    return (numel * element_bytes(dtype) + 3) // 4


def round_into(values: torch.Tensor, buffer: torch.Tensor, dtype: str) -> torch.Tensor:
    """`values` (fp32 or bf16, 1-d) rounded (or widened) to `dtype` inside `buffer` (fp32, at least
    scratch_numel(values.numel(), dtype) elements); returns the rounded tensor, a view of
    `buffer`."""
    numel = values.numel()
    rounded = buffer[: scratch_numel(numel, dtype)].view(PULL_DTYPES[dtype])[:numel]
    rounded.copy_(values)
    return rounded


@contextlib.contextmanager
def rounded(
    values: torch.Tensor,
    dtype: str,
    scratch: Callable[[int], contextlib.AbstractContextManager[torch.Tensor]] | None = None,
) -> Iterator[torch.Tensor]:
    """`values` rounded to `dtype` (round_into) in a buffer from `scratch(n)` (a StagingPool's
    borrow of n fp32 elements; None: a fresh tensor), for the block's duration."""
    n = scratch_numel(values.numel(), dtype)
    with scratch(n) if scratch else contextlib.nullcontext(torch.empty(n, dtype=torch.float32)) as buffer:
        yield round_into(values, buffer, dtype)


def tensor_bytes(values: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor of any of PULL_DTYPES, as they lie in memory (little-
    endian on every host we run on). Through uint8: numpy has no bfloat16."""
    return memoryview(values.view(torch.uint8).numpy())
