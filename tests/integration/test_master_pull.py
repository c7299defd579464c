"""Master pulls of shards on NVMe only, on a real daemon: the bytes of the committed version
(fp32 and bf16) without loading the shard, counted in Stats; a bad master region on disk is
DATA_LOSS for that shard while the others are served; a restart, from the same files or from
files of the previous format, serves and trains on as before."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.daemon.tiers.nvme import PAGE
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.pull import Pull
from ps_offload.trainer.debug_models import mlp
from ps_offload.trainer.wire.daemon_client import DaemonClient
from tests.helpers.nvme_files import committed_slot, downgrade_to_format_2

SHARD_BYTES = 8192
STEPS = 6
MODEL = "model"


def _case():
    torch.manual_seed(0)
    model = mlp((32, 64, 64, 10))  # 6922 parameters: 4 shards of 2048, the last of 778
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=g), torch.randint(10, (16,), generator=g)) for _ in range(STEPS)]
    return model, batches


def _train(opt, model, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.synchronize()


def _offload(model, address: str):
    return trainer.offload(
        model, daemons=[address], optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1),
        config=trainer.OffloadConfig(shard_bytes=SHARD_BYTES),
    )  # fmt: skip


def _daemon(tmp_path: Path, name: str) -> LocalDaemon:
    """With no learned order (prefetch_depth 0) there is no residency window: every master pull
    of a shard on NVMe reads its master region only (the window: test_residency_window in
    tests/ps_daemon/store)."""
    config = tmp_path / "no-window.toml"
    config.write_text("[store]\nprefetch_depth = 0\n")
    return LocalDaemon(tmp_path / name, "--nvme-dir", str(tmp_path / "nvme"), "--config", str(config))


def _admin(address: str, method: str, request):
    with grpc.insecure_channel(address) as channel:
        return getattr(ps_pb2_grpc.AdminStub(channel), method)(request, timeout=10)


def _stats(address: str) -> ps_pb2.StatsResponse:
    return _admin(address, "Stats", ps_pb2.StatsRequest())


def _tiers(address: str) -> list[str]:
    return [s.tier for s in _admin(address, "ListShards", ps_pb2.ListShardsRequest(model=MODEL)).shards]


def _evict_all(address: str, shards: int) -> None:
    for shard_id in range(shards):
        assert _admin(address, "Evict", ps_pb2.GetShardRequest(model=MODEL, shard_id=shard_id)).tier == "nvme"


def _pull(client: DaemonClient, placement, dtype=ps_pb2.FLOAT32) -> tuple[torch.Tensor, int]:
    values = torch.empty(placement.numel, dtype=torch.float32 if dtype == ps_pb2.FLOAT32 else torch.bfloat16)
    out = memoryview(values.view(torch.uint8).numpy())
    version = client.pull_into(Pull.of(MODEL, placement.shard_id, min_version=0, dtype=dtype), out=out, timeout=10)
    return values, version


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_evicted_shards_pull_their_committed_bytes_without_coming_back_to_ram(tmp_path):
    model, batches = _case()
    daemon = _daemon(tmp_path, "d")
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    try:
        with _offload(model, daemon.address) as opt:
            _train(opt, model, batches)
            plan = list(opt.plan)
        _evict_all(daemon.address, len(plan))
        before = _stats(daemon.address)
        flat = _flat(model)
        for placement in plan:
            for dtype in (ps_pb2.FLOAT32, ps_pb2.BFLOAT16):
                values, version = _pull(client, placement, dtype)
                expected = flat[placement.offset : placement.offset + placement.numel].to(values.dtype)
                assert version == STEPS and torch.equal(values.view(torch.uint8), expected.view(torch.uint8))
        after = _stats(daemon.address)
        assert _tiers(daemon.address) == ["nvme"] * len(plan)
        for field in ("ram_bytes_used", "evictions", "tier_misses", "tier_hits", "prefetched"):
            assert getattr(after, field) == getattr(before, field), field
        master_bytes = sum(-(-p.numel * 4 // PAGE) * PAGE for p in plan)
        assert after.nvme_master_reads - before.nvme_master_reads == 2 * len(plan)
        assert after.nvme_master_bytes_read - before.nvme_master_bytes_read == 2 * master_bytes
        assert after.nvme_bytes_read - before.nvme_bytes_read == 2 * master_bytes
    finally:
        client.close()
        daemon.kill()


def test_a_bad_master_region_is_data_loss_for_its_shard_while_the_others_are_served(tmp_path):
    model, batches = _case()
    daemon = _daemon(tmp_path, "d")
    client = DaemonClient(daemon.address, max_message_bytes=8 << 20)
    try:
        with _offload(model, daemon.address) as opt:
            _train(opt, model, batches[:2])
            plan = list(opt.plan)
        _evict_all(daemon.address, len(plan))
        with open(next((tmp_path / "nvme").glob("*.arena")), "r+b") as f:
            at = committed_slot(tmp_path / "nvme", 1) + PAGE + 100  # in shard 1's master values
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0xFF]))
        for dtype in (ps_pb2.FLOAT32, ps_pb2.BFLOAT16):  # and it stays refused
            with pytest.raises(grpc.RpcError) as info:
                _pull(client, plan[1], dtype)
            assert info.value.code() == grpc.StatusCode.DATA_LOSS and "shard 1 of model 'model'" in info.value.details()
        assert "shard 1 of model 'model' is corrupt on disk" in daemon.log()
        for placement in (plan[0], plan[2]):
            assert _pull(client, placement)[1] == 2
        assert _tiers(daemon.address) == ["nvme", "corrupt", "nvme", "nvme"]
    finally:
        client.close()
        daemon.kill()


@pytest.mark.parametrize("files_from", ["this release", "the previous release"])
def test_after_a_crash_the_recovered_shards_are_pulled_and_trained_on(tmp_path, files_from):
    """SIGKILL, then a new daemon on the same files (rewritten in format 2, as the release
    before master checksums left them, in the second case): every shard is on NVMe only, its
    pulls return what was trained, and training goes on equal to torch.optim's."""
    model, batches = _case()
    reference = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for x, y in batches:
        torch_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        torch_opt.step()

    first = _daemon(tmp_path, "a")
    try:
        with _offload(model, first.address) as opt:
            _train(opt, model, batches[: STEPS // 2])
            plan = list(opt.plan)
    finally:
        first.kill()
    if files_from == "the previous release":
        assert downgrade_to_format_2(tmp_path / "nvme") >= len(plan)
    second = _daemon(tmp_path, "b")
    client = DaemonClient(second.address, max_message_bytes=8 << 20)
    try:
        assert json.loads(next((tmp_path / "nvme").glob("*.json")).read_text())["format"] == 3
        assert _tiers(second.address) == ["nvme"] * len(plan)
        flat = _flat(model)
        for placement in plan:
            values, version = _pull(client, placement)
            expected = flat[placement.offset : placement.offset + placement.numel]
            assert version == STEPS // 2 and torch.equal(values, expected)
        stats = _stats(second.address)
        if files_from == "this release":  # read from disk, left there
            assert stats.nvme_master_reads == len(plan) and stats.tier_misses == 0
        else:  # no master checksum: loaded whole, as before
            assert stats.nvme_master_reads == 0 and stats.tier_misses == len(plan)
        resumed, _ = _case()
        with _offload(resumed, second.address) as opt:
            assert opt.step_count == STEPS // 2
            _train(opt, resumed, batches[STEPS // 2 :])
        for (name, ours), theirs in zip(resumed.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(ours, theirs), name
    finally:
        client.close()
        second.kill()
