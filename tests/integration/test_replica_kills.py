"""Issue 39's stress, at a small count: a replicated model's holder killed at each point inside
`opt.step()` (bench/replica_kills.py: before the pushes, as a push leaves, once it is
acknowledged, as a pull leaves, while the pulls land, while a replacement is caught up: the
replacement, or the holder it copies from), over fresh daemons on both transports, with a third
of the pulls held back at random. Every run ends bit for bit with torch.optim.AdamW, or, when
the second holder of some shards dies, fails naming them. `make soak` runs 300 of these
(REPLICA_KILL_RUNS here runs that many too)."""

from __future__ import annotations

import os

import pytest

from bench.replica_kills import POINTS, KillRun, expected, plans

RUNS = int(os.environ.get("REPLICA_KILL_RUNS", len(POINTS)))
SEED = int(os.environ.get("REPLICA_KILL_SEED", "39"))


@pytest.mark.parametrize("plan", plans(RUNS, SEED), ids=str)
def test_a_holder_killed_inside_a_step_ends_exact_or_fails_naming_the_shards(plan, tmp_path):
    outcome = KillRun(plan, tmp_path).run()
    assert expected(plan, outcome), (
        f"{plan}: {'bit for bit' if outcome.exact else 'not bit for bit'} with torch, killed {outcome.killed}, "
        f"lost {outcome.lost}, error: {outcome.error or 'none'}"
    )
