"""Adafactor on the daemons equals torch.optim.Adafactor in one process, bit for bit: real
daemons, matrices (factored), vectors, a conv kernel (factored over its last two dimensions),
a scalar, two param groups and a schedule, on the RAM tier and on NVMe; its state is a row and
a column per matrix on the daemon; and what needs per-element state is refused, saying why."""

from __future__ import annotations

import grpc
import pytest
import torch
from torch import nn

from ps_offload import trainer
from ps_offload.optimizers import GroupSettings, plugin_named
from ps_offload.proto import ps_pb2, ps_pb2_grpc

LR, WEIGHT_DECAY = 2e-2, 0.1
SHARD_BYTES = 4096


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)  # (4, 3, 3, 3): twelve 3 x 3 matrices, each factored
        self.a = nn.Linear(4 * 6 * 6, 200)
        self.b = nn.Linear(200, 200)  # 40000 elements: past torch's grain, so its norms use every thread
        self.c = nn.Linear(200, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))  # a scalar: its variance is one value

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.c(torch.tanh(self.b(torch.tanh(self.a(h))))) * self.scale


def _no_decay(name: str, param: nn.Parameter) -> bool:
    return param.ndim <= 1


def _case():
    torch.manual_seed(0)
    return Net(), [(torch.randn(4, 3, 8, 8), torch.randn(4, 3)) for _ in range(4)]


def _schedule(step: int) -> float:
    return 1 - step / 8


def _reference(model, batches) -> list[torch.Tensor]:
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not _no_decay(n, p)]},
        {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0},
    ]
    opt = torch.optim.Adafactor(groups, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def _daemon_config(tmp_path) -> object:
    """The daemon's optimizer threads as this process's torch threads (the module docstring of
    ps_offload.optimizers.adafactor: full-parameter norms past torch's grain follow the count)."""
    path = tmp_path / "threads.toml"
    path.write_text(f"[store]\noptimizer_threads = {torch.get_num_threads()}\n")
    return path


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_adafactor_on_the_daemons_is_torchs_bit_for_bit(tier, daemon_factory, tmp_path):
    model, batches = _case()
    want = _reference(_case()[0], batches)
    config = _daemon_config(tmp_path)
    if tier == "nvme":  # a RAM tier smaller than the model: shards reload from disk
        flags = ("--nvme-dir", str(tmp_path / "nvme"), "--create-nvme-dir", "--ram-bytes", "256KiB")
        daemons = [daemon_factory(*flags, config=config)]
    else:
        daemons = daemon_factory.together([(), ()], config=config)
    opt = trainer.offload(
        model, daemons=[d.address for d in daemons], optimizer=trainer.Adafactor(lr=LR, weight_decay=WEIGHT_DECAY),
        no_weight_decay=_no_decay, config=trainer.OffloadConfig(shard_bytes=SHARD_BYTES),
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    try:
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            scheduler.step()
        opt.synchronize()
        for got, expected in zip(model.parameters(), want, strict=True):
            assert torch.equal(got.detach(), expected), (got.detach() - expected).abs().max()
        if tier == "ram":  # the state is factored: master plus a few rows and columns, not 8 bytes a value
            numel = sum(p.numel() for p in model.parameters())
            used = 0
            for daemon in daemons:
                with grpc.insecure_channel(daemon.address) as channel:
                    used += ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=30).ram_bytes_used
            assert numel * 4 < used < numel * 4 * 1.2, (used, numel)
            _assert_per_element_state_is_refused(daemons[0].address)
    finally:
        opt.close()


def _assert_per_element_state_is_refused(address: str) -> None:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        pull = ps_pb2.PullRequest(model="model", shard_id=0, tensor=ps_pb2.EXP_AVG)
        list(ps_pb2_grpc.ParameterServerStub(channel).Pull(pull, timeout=30))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "runs adafactor, whose state is factored" in info.value.details()


def test_what_needs_per_element_state_is_refused_before_registering(daemon):
    model = _case()[0]
    with pytest.raises(ValueError, match="audit_every compares the optimizer state element by element"):
        trainer.offload(model, daemons=[daemon.address], optimizer=trainer.Adafactor(),
                        config=trainer.OffloadConfig(audit_every=1))  # fmt: skip
    with pytest.raises(ValueError, match="replicas=2: adafactor keeps factored state"):
        trainer.offload(model, daemons=[daemon.address, daemon.address], optimizer=trainer.Adafactor(),
                        config=trainer.OffloadConfig(replicas=2))  # fmt: skip
    spec = ps_pb2.ModelSpec(
        model="m", params=[ps_pb2.ParamSpec(name="w", shape=[8, 8], dtype=ps_pb2.FLOAT32)],
        optimizer=trainer.Adafactor().to_proto(), shard_bytes=4096, daemons=[daemon.address, daemon.address],
        replicas=2,
    )  # fmt: skip
    with grpc.insecure_channel(daemon.address) as channel, pytest.raises(grpc.RpcError) as info:
        ps_pb2_grpc.ParameterServerStub(channel).RegisterModel(ps_pb2.RegisterModelRequest(spec=spec), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adafactor keeps factored state" in info.value.details()
    with pytest.raises(ValueError, match="Adafactor d must be >= 1, got 0.5"):
        trainer.Adafactor(d=0.5)
    with pytest.raises(ValueError, match="Adafactor beta2_decay must be <= 0, got 0.1"):
        trainer.Adafactor(beta2_decay=0.1)


def test_a_push_names_adafactors_own_settings_or_is_refused():
    plugin, config = plugin_named("adafactor"), trainer.Adafactor()
    good = plugin.registered(config, 0.01, 0.0)
    assert plugin.check_group(config, good, "groups[0]") == ""
    missing = GroupSettings(0.01, 0.0, extra=(("d", 1.0), ("eps2", 1e-3)))
    assert plugin.check_group(config, missing, "groups[0]") == "groups[0].settings must hold beta2_decay"
    small_d = GroupSettings(0.01, 0.0, extra=(("beta2_decay", -0.8), ("d", 0.5), ("eps2", 1e-3)))
    assert "groups[0].settings['d'] must be finite and in [1, inf], got 0.5" in plugin.check_group(
        config, small_d, "groups[0]"
    )
