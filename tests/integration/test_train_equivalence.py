"""Training through real daemons ends with the same parameters as torch.optim in-process.

Exactness: bit-identical. The daemon runs the same fused kernel as
torch.optim.AdamW(fused=True) / SGD(fused=True) (torch._fused_adamw_ / _fused_sgd_), on one
view per parameter piece (so vector lanes and scalar tails fall on the same elements), with
the same fp32 gradients (sent as raw bytes) and the same step counts. Where a shard boundary
cuts a parameter at an offset that is not a multiple of 64, the daemon steps the cut block in a
scratch (ps_proto/plan.py, kernel_runs; test_odd_shapes.py covers odd shapes). Any
difference at all is a bug, hence torch.equal rather than a tolerance.
"""

from __future__ import annotations

import copy
import signal

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from ps_offload.trainer.wire.local_client import LocalClient
from tests.helpers.training import STEPS, gpt_case, mlp_case, no_decay, train_offloaded, train_reference


@pytest.mark.parametrize("case", [mlp_case, gpt_case], ids=["mlp", "transformer"])
@pytest.mark.parametrize("n_daemons", [1, 2])
@pytest.mark.parametrize("transport", ["local", "tcp", "grpc"], ids=["local", "data-plane", "grpc"])
def test_adamw_through_daemons_matches_torch_fused(case, n_daemons, transport, daemon_factory):
    model, batches, loss_fn = case()
    reference = copy.deepcopy(model)
    decay = [p for n, p in reference.named_parameters() if p.dim() >= 2]
    undecayed = [p for n, p in reference.named_parameters() if p.dim() < 2]
    torch_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": undecayed, "weight_decay": 0.0}],
        lr=3e-3,
        fused=True,
    )
    train_reference(reference, batches, loss_fn, torch_opt)

    daemons = daemon_factory.together([()] * n_daemons)
    # 8 KiB shards: several shards per daemon, parameters cut across shard boundaries.
    with trainer.offload(
        model,
        daemons=[d.address for d in daemons],
        optimizer=trainer.AdamW(lr=3e-3, weight_decay=0.1),
        no_weight_decay=no_decay,
        config=trainer.OffloadConfig(shard_bytes=8192),
        client=trainer.ClientConfig(transport=transport),
    ) as opt:
        assert len(opt.plan) >= 2 * n_daemons
        kind = {"local": LocalClient, "tcp": DataPlaneClient, "grpc": DaemonClient}[transport]
        assert [type(t) for t in opt.client.transports] == [kind] * n_daemons
        assert {s.daemon_index for s in opt.plan} == set(range(n_daemons))
        losses = train_offloaded(model, batches, loss_fn, opt)

    assert losses[-1] < losses[0]
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs), f"{name}: max |diff| {(ours - theirs).abs().max().item()}"


def _train_reference_delayed(model, batches, loss_fn, torch_opt):
    """The delayed update spelled out: step k's gradients are taken at the parameters of
    step k-1 (the first step at the initial ones) and applied to those of step k."""
    compute = copy.deepcopy(model)
    for batch in batches:
        compute.zero_grad()
        loss_fn(compute, batch).backward()
        before = [p.detach().clone() for p in model.parameters()]
        for master, stale in zip(model.parameters(), compute.parameters(), strict=True):
            master.grad = stale.grad.clone()
        torch_opt.step()
        with torch.no_grad():
            for stale, value in zip(compute.parameters(), before, strict=True):
                stale.copy_(value)
    return model


@pytest.mark.parametrize("n_daemons", [1, 2])
def test_staleness_one_is_the_delayed_update_exactly(n_daemons, daemon_factory):
    model, batches, loss_fn = gpt_case()
    delayed, exact = copy.deepcopy(model), copy.deepcopy(model)
    _train_reference_delayed(delayed, batches, loss_fn, torch.optim.AdamW(delayed.parameters(), lr=3e-3, fused=True))
    train_reference(exact, batches, loss_fn, torch.optim.AdamW(exact.parameters(), lr=3e-3, fused=True))
    assert not all(torch.equal(a, b) for a, b in zip(delayed.parameters(), exact.parameters(), strict=True))

    daemons = daemon_factory.together([()] * n_daemons)
    with trainer.offload(
        model,
        daemons=[d.address for d in daemons],
        optimizer=trainer.AdamW(lr=3e-3),
        config=trainer.OffloadConfig(shard_bytes=8192, staleness=1),
    ) as opt:
        losses = train_offloaded(model, batches, loss_fn, opt)
        assert opt.step_count == STEPS

    assert losses[-1] < losses[0]
    for (name, ours), theirs in zip(model.named_parameters(), delayed.parameters(), strict=True):
        assert torch.equal(ours, theirs), f"{name}: max |diff| {(ours - theirs).abs().max().item()}"


def test_staleness_one_failed_step_raises_and_is_submitted_again(daemon_factory, tmp_path):
    """The daemon dies (SIGKILL) while delayed steps are in flight and stays down past the
    client's retries: a later step() raises the daemon's error; once it is back (same port,
    same nvme_dir), calling step() again submits the failed step first, and the run ends
    exactly on the delayed-update reference."""
    model, batches, loss_fn = gpt_case()
    delayed = copy.deepcopy(model)
    _train_reference_delayed(delayed, batches, loss_fn, torch.optim.AdamW(delayed.parameters(), lr=3e-3, fused=True))
    nvme = str(tmp_path / "nvme")
    daemon = daemon_factory("--nvme-dir", nvme)
    port = daemon.port
    config = trainer.ClientConfig(retry_seconds=0.01, backoff_seconds=0.01)
    raised = []
    with trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=3e-3),
        config=trainer.OffloadConfig(shard_bytes=8192, staleness=1), client=config,
    ) as opt:  # fmt: skip
        for step, batch in enumerate(batches):
            opt.zero_grad()
            loss_fn(model, batch).backward()
            if step == 10:
                daemon.process.send_signal(signal.SIGKILL)
                daemon.process.wait()
            try:
                opt.step()
            except trainer.DaemonError as error:
                raised.append((step, error.code))
                daemon = daemon_factory("--nvme-dir", nvme, "--listen", f"127.0.0.1:{port}")
                opt.step()
        opt.synchronize()
    assert [code for _, code in raised] == [grpc.StatusCode.UNAVAILABLE], raised
    assert raised[0][0] in (10, 11)  # step 10's tasks fail; at step 10 or 11, as timing has it
    for (name, ours), theirs in zip(model.named_parameters(), delayed.parameters(), strict=True):
        assert torch.equal(ours, theirs), f"{name}: max |diff| {(ours - theirs).abs().max().item()}"


def test_sgd_momentum_through_daemon_matches_torch_fused(daemon):
    model, batches, loss_fn = mlp_case()
    reference = copy.deepcopy(model)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, fused=True)
    train_reference(reference, batches, loss_fn, torch_opt)
    with trainer.offload(
        model,
        daemons=[daemon.address],
        optimizer=trainer.SGD(lr=0.05, momentum=0.9, weight_decay=1e-4),
        config=trainer.OffloadConfig(shard_bytes=4096),
    ) as opt:
        train_offloaded(model, batches, loss_fn, opt)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_lr_schedule_is_applied_per_step(daemon):
    """The trainer owns the schedule; the lr set before step() is the one the daemon uses."""
    model, batches, loss_fn = mlp_case()
    reference = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    schedule = [1e-2 * (1 - i / STEPS) for i in range(STEPS)]
    for lr, batch in zip(schedule, batches, strict=True):
        torch_opt.param_groups[0]["lr"] = lr
        torch_opt.zero_grad()
        loss_fn(reference, batch).backward()
        torch_opt.step()
    with trainer.offload(
        model,
        daemons=[daemon.address],
        optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.0),
        config=trainer.OffloadConfig(shard_bytes=8192),
    ) as opt:
        for lr, batch in zip(schedule, batches, strict=True):
            opt.lr = lr
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_second_trainer_resumes_from_daemon_state(daemon):
    """Registering the same spec again attaches to the daemon's current parameters."""
    model, batches, loss_fn = mlp_case()
    with trainer.offload(
        model,
        daemons=[daemon.address],
        optimizer=trainer.AdamW(lr=1e-2),
        config=trainer.OffloadConfig(shard_bytes=8192),
    ) as opt:
        train_offloaded(model, batches[:5], loss_fn, opt)
        trained = [p.detach().clone() for p in model.parameters()]
    fresh, _, _ = mlp_case()  # different object, initial values
    with trainer.offload(
        fresh,
        daemons=[daemon.address],
        optimizer=trainer.AdamW(lr=1e-2),
        config=trainer.OffloadConfig(shard_bytes=8192),
    ) as opt:
        assert opt.step_count == 5
        for ours, theirs in zip(fresh.parameters(), trained, strict=True):
            assert torch.equal(ours, theirs)


def test_lr_zero_is_honoured_not_replaced_by_the_registered_lr(daemon):
    """lr is optional on the wire: an explicit 0 must freeze the parameters (with weight
    decay 0), not fall back to the registered lr."""
    model, batches, loss_fn = mlp_case()
    before = [p.detach().clone() for p in model.parameters()]
    with trainer.offload(
        model,
        daemons=[daemon.address],
        optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.0),
        config=trainer.OffloadConfig(shard_bytes=8192),
    ) as opt:
        opt.lr = 0.0
        opt.zero_grad()
        loss_fn(model, batches[0]).backward()
        opt.step()
        opt.synchronize()
        assert opt.step_count == 1
    for ours, theirs in zip(model.parameters(), before, strict=True):
        assert torch.equal(ours, theirs)


def test_daemon_without_data_plane_is_used_over_grpc(daemon_factory, tmp_path):
    config = tmp_path / "off.toml"
    config.write_text('[server]\ndata_listen = "off"\n')
    daemon = daemon_factory(config=config)
    model, batches, loss_fn = mlp_case()
    reference = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    train_reference(reference, batches[:10], loss_fn, torch_opt)
    with trainer.offload(
        model,
        daemons=[daemon.address],
        optimizer=trainer.AdamW(lr=1e-2),
        config=trainer.OffloadConfig(shard_bytes=8192),
    ) as opt:
        assert not any(isinstance(t, (DataPlaneClient, LocalClient)) for t in opt.client.transports)
        train_offloaded(model, batches[:10], loss_fn, opt)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
