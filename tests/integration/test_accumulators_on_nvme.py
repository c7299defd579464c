"""A daemon with an NVMe tier keeps the sums of a step pushed in parts on that tier: a real
daemon in a memory cgroup whose limit leaves less room than the sums take accumulates three
parts of a 64M-parameter model (256 MiB of fp32 sums against 128 MiB of headroom), applies
them and serves the result. Kept in anonymous memory, the same sums get the daemon killed by
the kernel (no swap here): ps_daemon/tiers/accumulator_files.py is what lets the kernel write
them back and reclaim them.

Needs a writable cgroup v1 memory controller (root, as on these machines); skipped otherwise,
with the reason."""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2
from ps_offload.proto.push import Push
from ps_offload.trainer.config import AdamW, ClientConfig
from ps_offload.trainer.io.device import byte_view
from ps_offload.trainer.wire.sharded_client import ShardedClient

CGROUPS = Path("/sys/fs/cgroup/memory")
NUMEL = 64 << 20  # fp32 sums of 256 MiB
SHARD_BYTES = 16 << 20
HEADROOM = 128 << 20  # the cgroup's limit: what the daemon holds after the initial push, plus this
PARTS = 3


def _memory_cgroup(name: str) -> Path:
    if not os.access(CGROUPS / "cgroup.procs", os.W_OK):
        pytest.skip(f"needs a writable cgroup v1 memory controller at {CGROUPS} (root)")
    group = CGROUPS / name
    group.mkdir(exist_ok=True)
    return group


@pytest.mark.slow
def test_sums_larger_than_the_daemons_memory_limit_are_paged_to_the_nvme_tier_and_applied(tmp_path):
    group = _memory_cgroup(f"ps-offload-test-{os.getpid()}")
    daemon = LocalDaemon(
        tmp_path / "d", "--nvme-dir", str(tmp_path / "nvme"), "--ram-bytes", "128MiB", "--shard-bytes", "16MiB"
    )
    pool = ThreadPoolExecutor(4)
    try:
        (group / "cgroup.procs").write_text(str(daemon.process.pid))
        client = ShardedClient([daemon.address], config=ClientConfig(retry_seconds=1.0))
        spec = ps_pb2.ModelSpec(model="m", optimizer=AdamW(lr=1e-3).to_proto(), shard_bytes=SHARD_BYTES)
        spec.params.add(name="w", shape=[NUMEL], dtype=ps_pb2.FLOAT32, group=0)
        plan = client.register(spec)
        values = torch.full((max(s.numel for s in plan),), 0.5)

        def push_all(kind: int, payload: torch.Tensor | None = None, **how) -> None:
            data = (lambda s: byte_view(payload[: s.numel])) if payload is not None else (lambda s: memoryview(b""))
            list(
                pool.map(
                    lambda s: client.push(
                        s, Push.unchecked(client.model, s.shard_id, data(s), step=0, kind=kind, **how)
                    ),
                    plan,
                )
            )

        push_all(ps_pb2.PARAMETERS, values)
        # Pages charged from here on: the sums (256 MiB) do not fit the headroom (128 MiB).
        usage = int((group / "memory.usage_in_bytes").read_text())
        (group / "memory.limit_in_bytes").write_text(str(usage + HEADROOM))
        for part in range(PARTS):
            push_all(ps_pb2.GRADIENT_PART, torch.full_like(values, 0.001 * (part + 1)), part=part)
        assert int((group / "memory.failcnt").read_text()) > 0  # the limit was reached, and reclaimed
        groups = [ps_pb2.GroupHyperparams(lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8)]
        push_all(ps_pb2.APPLY, groups=groups, parts=PARTS)
        assert daemon.process.poll() is None, "the daemon was killed"
        # AdamW's first step moves every value by lr against the sign of the (positive) sum.
        expected = torch.tensor(0.5) - torch.tensor(1e-3)
        for shard in (plan[0], plan[-1]):
            out = torch.empty(shard.numel)
            assert client.pull(shard, min_version=1, out=byte_view(out)) == 1
            assert torch.allclose(out, expected.expand_as(out), rtol=0, atol=1e-6), out[:4]
    finally:
        pool.shutdown()
        daemon.kill()
        _remove(group)


def _remove(group: Path) -> None:
    deadline = time.monotonic() + 30
    while group.exists():
        try:
            group.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            with contextlib.suppress(OSError):
                (group / "memory.force_empty").write_text("0")
            time.sleep(0.1)
