"""ps_proto/plan.py place_replicas: each shard on `replicas` distinct daemons, as far apart in
the list as the count allows, from the daemons' number and order alone."""

from __future__ import annotations

import pytest

from ps_offload.proto.plan import PlanError, place_replicas, plan_shards


@pytest.mark.parametrize(("daemons", "replicas"), [(2, 2), (3, 2), (4, 2), (5, 3), (8, 3), (7, 7)])
def test_every_shard_has_distinct_holders_and_every_daemon_an_even_share(daemons, replicas):
    plan = place_replicas(plan_shards(100 * 1024, 1024, daemons), daemons, replicas)
    step = daemons // replicas
    held = [0] * daemons
    for s in plan:
        assert len(set(s.holders)) == replicas and s.holders[0] == s.daemon_index
        assert s.holders == tuple((s.daemon_index + j * step) % daemons for j in range(replicas))
        for index in s.holders:
            held[index] += 1
    assert max(held) - min(held) <= replicas  # round-robin primaries: the shares differ by little


def test_a_list_written_node_by_node_puts_replicas_on_other_nodes():
    # Two daemons on each of three nodes, listed node by node.
    hosts = ["n0", "n0", "n1", "n1", "n2", "n2"]
    plan = place_replicas(plan_shards(60 * 1024, 1024, 6), 6, 3)
    for s in plan:
        assert len({hosts[i] for i in s.holders}) == 3


def test_one_replica_is_the_plan_as_it_was_and_too_many_are_refused():
    plan = plan_shards(10 * 1024, 1024, 3)
    assert place_replicas(plan, 3, 1) == plan and place_replicas(plan, 3, 0) == plan
    assert all(s.holders == (s.daemon_index,) for s in plan)
    with pytest.raises(PlanError, match="3 replicas need at least 3 daemons, the list has 2"):
        place_replicas(plan_shards(10 * 1024, 1024, 2), 2, 3)
