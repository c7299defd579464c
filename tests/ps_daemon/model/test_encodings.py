"""check_finite (ps_daemon/model/encodings.py): every kind of payload value that can be NaN or
infinite is found and named; finite values whose sum overflows are not refused."""

from __future__ import annotations

import math

import pytest
import torch

from ps_offload.daemon.errors import InvalidArgument
from ps_offload.daemon.model.encodings import CastGradient, OneBitGradient, TopKGradient, check_finite


def _with(values: torch.Tensor, at: int, bad: float) -> torch.Tensor:
    values = values.clone()
    values[at] = bad
    return values


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("at", [0, 1, 4095, 10_000])
def test_a_raw_non_finite_element_is_named_wherever_it_is(bad, at):
    with pytest.raises(InvalidArgument, match=rf"push to shard 2: element {at} is {bad}; nothing was applied"):
        check_finite(_with(torch.ones(10_001), at, bad), "push to shard 2")


def test_compressed_payloads_name_what_is_bad():
    half = CastGradient(_with(torch.ones(64), 7, math.nan).half())
    with pytest.raises(InvalidArgument, match="element 7 is nan"):
        check_finite(half, "p")
    scales = _with(torch.ones(3), 2, -math.inf)
    with pytest.raises(InvalidArgument, match="block scale 2 is -inf"):
        check_finite(OneBitGradient(scales=scales, bits=torch.zeros(300, dtype=torch.uint8), numel=2400), "p")
    topk = TopKGradient(
        indices=torch.tensor([3, 9, 40], dtype=torch.int32), values=_with(torch.ones(3), 1, math.inf), numel=64
    )
    with pytest.raises(InvalidArgument, match=r"value 1 \(of element 9\) is inf"):
        check_finite(topk, "p")


def test_finite_values_pass_even_when_their_sum_overflows():
    huge = torch.full((8,), 3e38)  # each finite; their sum is inf
    assert not torch.isfinite(huge.sum())
    check_finite(huge, "p")
    check_finite(CastGradient(torch.full((4,), 60000.0).half()), "p")  # sums past fp16's range
    check_finite(torch.zeros(5), "p")
