"""The Prometheus endpoint of a real daemon, scraped after training through it: the counters
agree with what the trainer did, RPC latencies are recorded per method and status code (the
data plane's too), the optimizer's step time per shard, the tiers and NVMe traffic."""

from __future__ import annotations

import socket

import grpc
import pytest
import torch

import ps_offload
from ps_offload import trainer
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.frames import send_message
from ps_offload.trainer.debug_models import mlp
from tests.helpers.data_plane import register_with_data_plane
from tests.helpers.metrics import daemon_with_metrics, scrape_metrics
from tests.helpers.waiting import until, until_stats

STEPS = 4


def _train(address: str, transport: str) -> tuple[int, int]:
    """Trains STEPS steps; returns (parameters, shards)."""
    torch.manual_seed(0)
    model = mlp((64, 64, 10))
    numel = sum(p.numel() for p in model.parameters())
    config = trainer.ClientConfig(transport=transport)
    with trainer.offload(
        model,
        daemons=[address],
        optimizer=trainer.AdamW(),
        config=trainer.OffloadConfig(shard_bytes=8192),
        client=config,
    ) as opt:
        for _ in range(STEPS):
            opt.zero_grad()
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
        opt.synchronize()
        return numel, len(opt.plan)


@pytest.mark.parametrize("transport", ["local", "tcp", "grpc"])
def test_metrics_count_what_the_trainer_did(daemon_factory, tmp_path, transport):
    daemon, port = daemon_with_metrics(daemon_factory, tmp_path)
    numel, shards = _train(daemon.address, transport)
    with grpc.insecure_channel(daemon.address) as channel:  # one refused call, to see its code
        with pytest.raises(grpc.RpcError):
            ps_pb2_grpc.AdminStub(channel).GetShard(ps_pb2.GetShardRequest(model="nope", shard_id=0), timeout=10)
    plane = {"local": "Local", "tcp": "DataPlane", "grpc": "ParameterServer"}[transport]
    push_count = ("ps_rpc_duration_seconds_count", (("code", "OK"), ("method", f"{plane}/Push")))
    pull_count = ("ps_rpc_duration_seconds_count", (("code", "OK"), ("method", f"{plane}/Pull")))

    def counted(m: dict) -> bool:
        served = m.get(pull_count, 0) + m[("ps_pulls_carried_total", ())]
        return m.get(push_count) == shards * (STEPS + 1) and served == m[("ps_pulls_total", ())]

    # The data planes time a request until its answer is sent, and count it after: the trainer
    # may have the last answer (and this test scrape) before that count lands (CI saw 14 of 15).
    until(lambda: counted(scrape_metrics(port)), f"every {plane} push and pull counted")
    m = scrape_metrics(port)
    assert m[("ps_pushed_bytes_total", ())] == 4 * numel * (STEPS + 1)  # initial values + STEPS gradients
    assert m[("ps_pushes_total", (("result", "applied"),))] == shards * STEPS
    assert m[("ps_optimizer_step_duration_seconds_count", ())] == shards * STEPS
    assert m[("ps_optimizer_step_duration_seconds_sum", ())] > 0
    assert m[("ps_shards", (("tier", "ram"),))] == shards
    assert m[("ps_tier_capacity_bytes", (("tier", "ram"),))] == 8 << 30
    assert m[push_count] == shards * (STEPS + 1)
    pulls = m.get(pull_count, 0)
    carried = m[("ps_pulls_carried_total", ())]  # a local push carries its step's pull (pull_into)
    assert carried == (shards * STEPS if transport == "local" else 0)
    assert pulls + carried == m[("ps_pulls_total", ())] >= shards * STEPS
    assert m[("ps_rpc_duration_seconds_count", (("code", "OK"), ("method", "ParameterServer/RegisterModel")))] == 1
    assert m[("ps_rpc_duration_seconds_count", (("code", "NOT_FOUND"), ("method", "Admin/GetShard")))] == 1
    assert m[("ps_local_pool_bytes", ())] > 0 and ("ps_local_pool_bytes_used", ()) in m
    assert m[("ps_clients", (("transport", "grpc"),))] == (transport == "grpc")  # its calls of the last minute
    (build,) = [labels for name, labels in m if name == "ps_build_info"]
    assert dict(build)["version"] == ps_offload.__version__ and dict(build)["torch"] == torch.__version__


def test_nvme_bytes_and_seconds_and_tiers(daemon_factory, tmp_path):
    daemon, port = daemon_with_metrics(daemon_factory, tmp_path, "--nvme-dir", str(tmp_path / "nvme"))
    numel, shards = _train(daemon.address, "tcp")
    with grpc.insecure_channel(daemon.address) as channel:
        ps_pb2_grpc.AdminStub(channel).Evict(ps_pb2.GetShardRequest(model="model", shard_id=0), timeout=10)
    m = scrape_metrics(port)
    arena = m[("ps_nvme_written_bytes_total", ())] / (shards * (STEPS + 1))  # every version committed
    assert arena >= 12 * numel / shards  # master, m and v of a shard (and the arena's stagger)
    assert m[("ps_nvme_write_seconds_total", ())] > 0
    commits, groups = m[("ps_nvme_commits_total", ())], m[("ps_nvme_commit_groups_total", ())]
    assert commits == shards * (STEPS + 1) and 1 <= groups <= commits
    assert m[("ps_nvme_flushes_total", ())] == 2 * groups  # one model's groups run one at a time
    assert m[("ps_nvme_flush_seconds_total", ())] > 0
    assert m[("ps_shards", (("tier", "nvme"),))] == 1 and m[("ps_shards", (("tier", "ram"),))] == shards - 1
    assert m[("ps_tier_bytes", (("tier", "nvme"),))] > 0


def test_no_metrics_endpoint_unless_configured(daemon):
    assert "metrics on http" not in daemon.log()


def test_waiting_pulls_and_data_plane_connections_are_gauged(daemon_factory, tmp_path):
    """A data plane pull parked for a version no one pushes shows as waiting on the data
    plane (a gRPC one would show under "grpc"), and its connection is counted."""
    daemon, port = daemon_with_metrics(daemon_factory, tmp_path)
    client, data, response = register_with_data_plane(daemon)
    data.close()
    with socket.create_connection(("127.0.0.1", response.data_port), timeout=30) as sock:
        pull = ps_pb2.PullRequest(model="m", shard_id=0, min_version=9)
        send_message(sock, ps_pb2.DataRequest(pull=pull, timeout_ms=120_000))
        until_stats(lambda s: s.data_pulls_waiting == 1 and s.data_connections == 1, "the pull parked, alone", client)
        samples = scrape_metrics(port)
        assert samples[("ps_pulls_waiting", (("transport", "data_plane"),))] == 1
        assert samples[("ps_pulls_waiting", (("transport", "grpc"),))] == 0
        assert samples[("ps_data_connections", ())] == 1
        assert samples[("ps_data_connections_refused_total", ())] == 0
    client.close()
