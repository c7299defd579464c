"""The offload optimizer is a torch.optim.Optimizer: torch's LR schedulers drive the daemons'
settings exactly as they drive torch.optim.AdamW in process, per param group; state_dict and
load_state_dict keep torch's shape; what the daemons cannot follow is refused before a push."""

from __future__ import annotations

import copy

import pytest
import torch

from ps_offload import trainer
from ps_offload.trainer.debug_models import mlp

STEPS = 12


def _case():
    torch.manual_seed(0)
    model = mlp((19, 33, 7))
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 19, generator=g), torch.randint(7, (8,), generator=g)) for _ in range(STEPS)]
    return model, batches


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _no_decay(name, p):
    return p.dim() < 2


SCHEDULES = {
    "lambda-per-group": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.9**s, lambda s: 1.0 / (1 + s)]),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-5),
    "warmup-then-cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 4),
        ],
        milestones=[4],
    ),  # fmt: skip
    # OneCycleLR also cycles beta1 (group["betas"]): the daemons apply it per step too.
    "one-cycle-with-betas": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_torch_schedulers_drive_the_daemons_as_torch_adamw(schedule, daemon_factory):
    model, batches = _case()
    reference = copy.deepcopy(model)
    groups = [
        {"params": [p for p in reference.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in reference.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    torch_opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-7, fused=True)
    torch_sched = SCHEDULES[schedule](torch_opt)
    for batch in batches:
        torch_opt.zero_grad()
        _loss(reference, batch).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch_opt.step()
        torch_sched.step()

    daemons = daemon_factory.together([(), ()])
    with trainer.offload(
        model, daemons=[d.address for d in daemons], no_weight_decay=_no_decay,
        optimizer=trainer.AdamW(lr=3e-3, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.1),
        config=trainer.OffloadConfig(shard_bytes=4096),
    ) as opt:  # fmt: skip
        assert isinstance(opt, torch.optim.Optimizer)
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        sched = SCHEDULES[schedule](opt)
        for batch in batches:
            opt.zero_grad()
            _loss(model, batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
        opt.synchronize()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in torch_opt.param_groups]
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_sgd_with_a_momentum_schedule_matches_torch_sgd(daemon_factory):
    model, batches = _case()
    reference = copy.deepcopy(model)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(torch_opt, max_lr=0.1, total_steps=STEPS)  # cycles momentum
    for batch in batches:
        torch_opt.zero_grad()
        _loss(reference, batch).backward()
        torch_opt.step()
        sched.step()
    daemon = daemon_factory()
    with trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.SGD(lr=0.05, momentum=0.9),
        config=trainer.OffloadConfig(shard_bytes=4096),
    ) as opt:  # fmt: skip
        ours = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
        for batch in batches:
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step(closure=None)
            ours.step()
        opt.synchronize()
    for ours_p, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours_p, theirs)


def test_state_dict_has_torchs_shape_and_names_the_daemons_version(daemon_factory):
    model, batches = _case()
    daemon = daemon_factory()
    kwargs = dict(daemons=[daemon.address], optimizer=trainer.AdamW(lr=1e-3), no_weight_decay=_no_decay,
                  config=trainer.OffloadConfig(model_name="ckpt", shard_bytes=4096))  # fmt: skip
    with trainer.offload(model, **kwargs) as opt:
        for batch in batches[:3]:
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()
        opt.param_groups[1]["lr"] = 5e-4  # as a scheduler would
        saved = opt.state_dict()
        assert set(saved) == {"state", "param_groups", "ps_offload"}
        assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2, 3]]
        assert saved["ps_offload"]["model"] == "ckpt" and saved["ps_offload"]["version"] == 3
        opt.zero_grad()
        _loss(model, batches[3]).backward()
        opt.step()  # the daemons move on to version 4
    stale = copy.deepcopy(saved)

    # A new process resumes from the daemons (version 4); a state dict taken there loads ...
    resumed_model = mlp((19, 33, 7))
    with trainer.offload(resumed_model, **kwargs) as resumed:
        assert resumed.step_count == 4
        current = resumed.state_dict()
        current["param_groups"][1]["lr"] = 2e-4
        resumed.load_state_dict(current)
        assert resumed.param_groups[1]["lr"] == 2e-4
        # ... one of version 3 does not: the daemons hold only their newest state.
        with pytest.raises(ValueError, match="at version 3, the daemons hold 'ckpt' at version 4"):
            resumed.load_state_dict(stale)
        assert resumed.param_groups[1]["lr"] == 2e-4  # refused before anything changed
        for ours, theirs in zip(resumed_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(ours, theirs)


def test_what_the_daemons_cannot_follow_is_refused_before_any_push(daemon_factory):
    model, batches = _case()
    daemon = daemon_factory()
    with trainer.offload(
        model, daemons=[daemon.address], optimizer=trainer.AdamW(), config=trainer.OffloadConfig(shard_bytes=4096)
    ) as opt:  # fmt: skip
        with pytest.raises(ValueError, match="cannot be added after offload"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        _loss(model, batches[0]).backward()
        for key, value, message in [
            ("amsgrad", True, "amsgrad=True is not run by the daemons"),
            ("lr", float("nan"), "lr must be finite"),
            ("weight_decay", -1.0, "weight_decay must be finite and >= 0"),
        ]:
            saved = opt.param_groups[0].get(key)
            opt.param_groups[0][key] = value
            with pytest.raises(ValueError, match=message):
                opt.step()
            opt.param_groups[0][key] = saved
            if saved is None:
                del opt.param_groups[0][key]
        assert opt.step_count == 0  # nothing was pushed
        opt.step()
        assert opt.step_count == 1
