"""Replicated models on one daemon, without a network: which shards a daemon holds (its
primaries and the replicas placed on it), the spec's replicas kept across a restart, and the
refusals (more replicas than daemons; the same model registered with another count)."""

from __future__ import annotations

import dataclasses

import pytest

from ps_offload.daemon.composition import open_store
from ps_offload.daemon.errors import FailedPrecondition, InvalidArgument
from ps_offload.daemon.model.kernel_digest import kernel_digest
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec, spec_from_dict, spec_to_dict
from ps_offload.optimizers import AdamW

SHARD_NUMEL = 1024


def _spec(replicas: int, daemons: int = 3) -> ModelSpec:
    params = (ParamSpec("w", (SHARD_NUMEL * 6,)),)
    return ModelSpec("m", params, AdamW(), SHARD_NUMEL * 4, tuple(f"d{i}:1" for i in range(daemons)), replicas)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_daemon_holds_its_primaries_and_the_replicas_placed_on_it(index):
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=SHARD_NUMEL * 4)
    model, created = store.registry.register(_spec(2), index)
    assert created
    held = {s.shard_id for s in model.plan if index in s.holders}
    assert set(model.shards) == held
    assert len(held) == 4  # 6 shards x 2 holders over 3 daemons
    assert all(s.holders == (s.daemon_index, (s.daemon_index + 1) % 3) for s in model.plan)


def test_more_replicas_than_daemons_is_refused_at_registration():
    with pytest.raises(InvalidArgument, match="3 replicas of each shard need as many daemons; the list has 2"):
        open_store(ram_bytes=1 << 30, default_shard_bytes=SHARD_NUMEL * 4).registry.register(_spec(3, daemons=2), 0)


def test_the_same_model_with_another_replica_count_is_refused():
    store = open_store(ram_bytes=1 << 30, default_shard_bytes=SHARD_NUMEL * 4)
    store.registry.register(_spec(2), 0)
    with pytest.raises(FailedPrecondition, match="replicas was 2, now 1"):
        store.registry.register(_spec(1), 0)


def test_the_spec_keeps_its_replicas_on_disk_and_older_records_read_as_one():
    spec = _spec(2)
    assert spec_from_dict(spec_to_dict(spec)) == spec
    older = spec_to_dict(spec)
    del older["replicas"]
    assert spec_from_dict(older) == dataclasses.replace(spec, replicas=1)


def test_the_kernel_digest_is_stable_within_a_process_and_names_the_bits():
    assert kernel_digest("adamw") == kernel_digest("adamw") != kernel_digest("sgd")
    assert len(kernel_digest("adamw")) == 16 and int(kernel_digest("adamw"), 16) >= 0
