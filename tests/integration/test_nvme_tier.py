"""A model whose optimizer state is several times the RAM tier trains through one daemon
to the same parameters as torch.optim in-process, and the RAM tier stays in its budget."""

from __future__ import annotations

import copy
import threading
import time

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2, ps_pb2_grpc

RAM_BYTES = 16 << 20
STEPS = 6


def _rss_bytes(pid: int) -> int:
    """The process's own resident memory: VmRSS less RssShmem, the trainer's buffers it maps
    through the local transport (its windows count in both processes' RSS)."""
    fields = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"] - fields.get("RssShmem", 0)


def _stats(address: str) -> ps_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10)


@pytest.mark.slow
def test_state_three_times_ram_trains_exactly_within_the_budget(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1536), torch.nn.ReLU(), torch.nn.Linear(1536, 1536), torch.nn.ReLU(),
        torch.nn.Linear(1536, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10),
    )  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * n_params  # fp32 master, m, v
    assert state_bytes >= 3 * RAM_BYTES, state_bytes
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 1024, generator=g), torch.randint(10, (8,), generator=g)) for _ in range(STEPS)]

    reference = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for x, y in batches:
        torch_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        torch_opt.step()

    daemon = LocalDaemon(tmp_path / "d", "--nvme-dir", str(tmp_path / "nvme"), "--ram-bytes", str(RAM_BYTES))
    try:
        # The baseline once the optimizer kernel is compiled (at start, beside serving): its code
        # and the compiler's memory are the daemon's from then on, whatever it holds.
        _until_logged(daemon, "optimizer kernel")
        baseline_rss = _rss_bytes(daemon.process.pid)
        samples: list[tuple[int, int]] = []
        done = threading.Event()

        def sample() -> None:  # the tier's own count and the process's memory, while training
            while not done.is_set():
                samples.append((_stats(daemon.address).ram_bytes_used, _rss_bytes(daemon.process.pid)))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        with trainer.offload(
            model,
            daemons=[daemon.address],
            optimizer=trainer.AdamW(lr=1e-3, weight_decay=0.1),
            config=trainer.OffloadConfig(shard_bytes=1 << 20),
        ) as opt:
            assert len(opt.plan) * (3 << 20) > 3 * RAM_BYTES
            sampler.start()
            for x, y in batches:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            opt.synchronize()
        done.set()
        sampler.join(10)

        for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(ours, theirs), name
        assert samples and max(used for used, _ in samples) <= RAM_BYTES
        # The process holds the tier, staging and transport buffers (about 17 MB more here, in
        # a heap kept from shrinking by ps_proto/memory.py), never the whole state: with every
        # shard resident it would grow by the state *and* those buffers.
        grown = max(rss for _, rss in samples) - baseline_rss
        assert grown < state_bytes, (grown, state_bytes)
        stats = _stats(daemon.address)
        assert stats.tier_misses > 0 and stats.evictions > 0 and stats.nvme_bytes_read > 0
        assert stats.tier_hits > 0  # pulls right after their push, and prefetched shards
    finally:
        daemon.kill()


def _admin(daemon: LocalDaemon, *args: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "ps_offload.admin", *args, "--daemon", daemon.address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_admin_evict_and_prefetch_move_shards_between_tiers(tmp_path):
    import json

    daemon = LocalDaemon(tmp_path / "d", "--nvme-dir", str(tmp_path / "nvme"), "--ram-bytes", str(RAM_BYTES))
    try:
        model = torch.nn.Linear(64, 64)
        with trainer.offload(
            model, daemons=[daemon.address], optimizer=trainer.AdamW(), config=trainer.OffloadConfig(shard_bytes=4096)
        ) as opt:
            opt.zero_grad()
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            opt.synchronize()
            trained = torch.cat([p.detach().flatten() for p in model.parameters()])
        tiers = {r["shard_id"]: r["tier"] for r in json.loads(_admin(daemon, "shards", "--json").stdout)}
        assert tiers[0] == "ram"
        result = _admin(daemon, "evict", "0", "1")
        assert result.returncode == 0 and "shard 0: nvme" in result.stdout and "shard 1: nvme" in result.stdout
        tiers = {r["shard_id"]: r["tier"] for r in json.loads(_admin(daemon, "shards", "--json").stdout)}
        assert tiers[0] == tiers[1] == "nvme"
        result = _admin(daemon, "prefetch", "0")
        assert result.returncode == 0 and "shard 0: ram" in result.stdout
        missing = _admin(daemon, "evict", "99")
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr and "Traceback" not in missing.stderr
        # The values survived the trip to NVMe and back: shard 0's norm is the trained one.
        shard = json.loads(_admin(daemon, "shard", "0", "--json").stdout)
        expected = float(torch.linalg.vector_norm(trained[: shard["numel"]]))
        assert shard["tier"] == "ram" and abs(shard["norm"] - expected) <= 1e-5 * expected
    finally:
        daemon.kill()


def test_evict_without_nvme_tier_is_failed_precondition(tmp_path):
    daemon = LocalDaemon(tmp_path / "d")
    try:
        model = torch.nn.Linear(8, 8)
        with trainer.offload(
            model, daemons=[daemon.address], optimizer=trainer.AdamW(), config=trainer.OffloadConfig(shard_bytes=4096)
        ):
            pass
        result = _admin(daemon, "evict", "0")
        assert result.returncode == 1 and "FAILED_PRECONDITION" in result.stderr and "nvme_dir" in result.stderr
    finally:
        daemon.kill()


def test_trainer_prefetch_hint_brings_evicted_shards_back(tmp_path):
    import json

    daemon = LocalDaemon(tmp_path / "d", "--nvme-dir", str(tmp_path / "nvme"), "--ram-bytes", str(RAM_BYTES))
    try:
        model = torch.nn.Linear(64, 64)
        with trainer.offload(
            model, daemons=[daemon.address], optimizer=trainer.AdamW(), config=trainer.OffloadConfig(shard_bytes=4096)
        ) as opt:
            assert _admin(daemon, "evict", "0", "1", "2").returncode == 0
            opt.client.prefetch([2, 0])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                tiers = {r["shard_id"]: r["tier"] for r in json.loads(_admin(daemon, "shards", "--json").stdout)}
                if tiers[0] == tiers[2] == "ram":
                    break
                time.sleep(0.1)
            assert tiers[0] == tiers[2] == "ram" and tiers[1] == "nvme"
        stats = _stats(daemon.address)
        assert stats.prefetch_hints == 2 and stats.prefetched == 2
    finally:
        daemon.kill()


@pytest.mark.parametrize("hints", [True, False])
def test_trainer_hints_bring_the_next_steps_first_shards_back_after_each_step(tmp_path, hints):
    """With the daemon's learned prefetch off, only the trainer's end-of-step hint can bring
    the first shards of the next step back into RAM before their pushes: LRU alone leaves
    the last shards of the step resident. (5 shards: 4 of 1024 parameters and one of 64;
    the tier holds three large ones and the small one.)"""
    import json

    config = tmp_path / "no-learned.toml"
    config.write_text("[store]\nprefetch_depth = 0\n")
    daemon = LocalDaemon(
        tmp_path / "d", "--nvme-dir", str(tmp_path / "nvme"), "--ram-bytes", str(48 << 10), "--config", str(config)
    )
    try:
        model = torch.nn.Linear(64, 64)
        client = trainer.ClientConfig(prefetch_hints=hints)
        with trainer.offload(
            model,
            daemons=[daemon.address],
            optimizer=trainer.AdamW(),
            config=trainer.OffloadConfig(shard_bytes=4096),
            client=client,
        ) as opt:
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(2, 64)).sum().backward()
                opt.step()
            opt.synchronize()
            deadline = time.monotonic() + (10 if hints else 1)
            while time.monotonic() < deadline:
                tiers = {r["shard_id"]: r["tier"] for r in json.loads(_admin(daemon, "shards", "--json").stdout)}
                if tiers[0] == tiers[1] == "ram" and tiers[3] == "nvme":
                    break
                time.sleep(0.1)
        stats = _stats(daemon.address)
        if hints:
            # Shard 0 came back, and to make room the hint's order evicted the shards needed
            # last, not the least recently used one (1, needed right after 0). Shard 4 (the
            # small one) may stay: three large arenas and it fit in the budget, and whether it
            # goes too depends on a freed arena still being pooled at that moment.
            assert [tiers[s] for s in (0, 1, 2, 3)] == ["ram", "ram", "ram", "nvme"], tiers
            assert stats.prefetch_hints == 2 * 5 and stats.prefetched >= 1
        else:  # turned off: nothing is hinted or prefetched (what LRU leaves varies with timing)
            assert stats.prefetch_hints == 0 and stats.prefetched == 0
    finally:
        daemon.kill()


def test_hints_go_only_to_daemons_with_an_nvme_tier(tmp_path):
    """A RAM-only daemon has nothing to prefetch: the registration says which daemons have an
    NVMe tier, and the end-of-step hint goes to those only (on the others it was a gRPC call
    on each side per step for nothing)."""
    ram_only = LocalDaemon(tmp_path / "ram")
    with_nvme = LocalDaemon(tmp_path / "nvme", "--nvme-dir", str(tmp_path / "files"))
    try:
        model = torch.nn.Linear(64, 64)
        addresses = [ram_only.address, with_nvme.address]
        opt = trainer.offload(
            model, daemons=addresses, optimizer=trainer.AdamW(), config=trainer.OffloadConfig(shard_bytes=4096)
        )
        with opt:
            assert opt.client.nvme_daemons == {1}
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(2, 64)).sum().backward()
                opt.step()
        # close() waited for the hint tasks, so every hint sent has been counted.
        on_nvme = sum(1 for s in opt.plan if s.daemon_index == 1)
        assert _stats(ram_only.address).prefetch_hints == 0
        assert _stats(with_nvme.address).prefetch_hints == 3 * on_nvme
    finally:
        ram_only.kill()
        with_nvme.kill()


def test_registration_past_nvme_bytes_is_resource_exhausted(tmp_path):
    daemon = LocalDaemon(
        tmp_path / "d", "--nvme-dir", str(tmp_path / "nvme"), "--ram-bytes", str(RAM_BYTES), "--nvme-bytes", "1MiB"
    )
    try:
        model = torch.nn.Linear(256, 256)  # 65792 parameters: 776 KiB of AdamW state, 1.2 MiB with slots
        with pytest.raises(trainer.DaemonError) as info:
            trainer.offload(
                model,
                daemons=[daemon.address],
                optimizer=trainer.AdamW(),
                config=trainer.OffloadConfig(shard_bytes=64 << 10),
            )
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "store.nvme_bytes is 1048576" in str(info.value) and "spare" in str(info.value)
        assert not list((tmp_path / "nvme").glob("*.arena"))
        # The daemon goes on serving: a model that fits registers.
        with trainer.offload(torch.nn.Linear(16, 16), daemons=[daemon.address], optimizer=trainer.AdamW()):
            pass
    finally:
        daemon.kill()


def _until_logged(daemon: LocalDaemon, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in daemon.log():
        assert time.monotonic() < deadline, f"the daemon never logged {text!r}:\n{daemon.log()}"
        time.sleep(0.05)
