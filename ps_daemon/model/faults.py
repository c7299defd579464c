"""Testing aid: `PS_OFFLOAD_FAULT_PERTURB_STEP=N` makes the daemon commit a wrong update on
purpose, so that the trainer's parity audit (trainer/offload/audit.py, `OffloadConfig.audit_every`)
can be shown to catch one: after applying step N's gradient to a shard (its version N ->
N + 1), the shard's first master value is moved one ulp up, as a miscompiled kernel or a
flipped bit would leave it. Every shard stepped at N is hit. Never set it outside tests.
Unset: one comparison per update."""

from __future__ import annotations

import math
import os

import torch

ENV = "PS_OFFLOAD_FAULT_PERTURB_STEP"


def _parse(setting: str | None) -> int | None:
    if not setting:
        return None
    try:
        step = int(setting)
    except ValueError:
        raise ValueError(f"{ENV}={setting!r}: a step number (an int >= 0)") from None
    if step < 0:
        raise ValueError(f"{ENV}={setting!r}: a step number (an int >= 0)")
    return step


_step = _parse(os.environ.get(ENV))


def after_update(master: torch.Tensor, step: torch.Tensor) -> bool:
    """Called once an update has been applied to `master`; `step` is the optimizer's count
    after it (the shard's new version). Whether it moved a value."""
    if _step is None or int(step.item()) != _step + 1:
        return False
    first = master[:1]
    first.copy_(torch.nextafter(first, torch.full_like(first, math.inf)))  # the next float32 up
    return True
