"""The parity audit (OffloadConfig.audit_every, trainer/offload/audit.py) against real daemons: it
passes on honest daemons whatever the dtype, optimizer, param groups, clipping and shard cuts,
it rotates through the shards, it catches a daemon that commits a wrong update (injected with
PS_OFFLOAD_FAULT_PERTURB_STEP, ps_daemon/model/faults.py), and what it cannot recompute is refused
when the optimizer is built."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.daemon.model.faults import ENV as PERTURB_STEP
from ps_offload.proto.plan import shard_numel_for
from ps_offload.trainer.offload.audit import AuditMismatch
from tests.helpers.odd_shapes import odd_case, odd_cuts
from tests.helpers.training import no_decay

SHARD_BYTES = 4096  # 1024 elements: cuts inside fc2.weight and fc3.weight at odd offsets
STEPS = 8  # the odd model has 7 shards: shard 0 is audited twice


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on a loaded machine
    yield
    torch.set_num_threads(before)


def _optimizer(kind: str) -> trainer.AdamW | trainer.SGD:
    if kind == "adamw":
        return trainer.AdamW(lr=3e-3, weight_decay=0.1)
    return trainer.SGD(lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)


def _train(opt, model, batches, loss_fn, *, clip: str, dtype: torch.dtype) -> None:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))  # groups change every step
    for x, y in batches:
        loss = loss_fn(model, (x.to(dtype), y.to(dtype))).float()
        loss.backward()
        if clip == "torch":  # the gradients themselves are clipped
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif clip == "daemons":  # the step carries the coefficient as its grad multiplier
            opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.synchronize()


CASES = {
    "adamw-fp32-torch-clip": ("adamw", torch.float32, "torch", {}),
    "adamw-bf16-multiplier": ("adamw", torch.bfloat16, "daemons", {}),
    "adamw-fp32-push-in-backward": ("adamw", torch.float32, "daemons", {"push_in_backward": True}),
    "sgd-fp32-torch-clip": ("sgd", torch.float32, "torch", {}),
    "sgd-bf16-multiplier": ("sgd", torch.bfloat16, "daemons", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_audits_pass_on_honest_daemons_and_rotate_through_the_shards(case, daemons):
    kind, dtype, clip, extra = CASES[case]
    model, batches, loss_fn = odd_case(STEPS)
    assert odd_cuts(model, shard_numel_for(SHARD_BYTES))  # parameters cut mid-way, off the kernels' blocks
    model.to(dtype)
    with trainer.offload(
        model,
        daemons=daemons,
        optimizer=_optimizer(kind),
        no_weight_decay=no_decay,  # two param groups
        config=trainer.OffloadConfig(model_name=f"audit-{case}", shard_bytes=SHARD_BYTES, audit_every=1, **extra),
    ) as opt:
        shards = len(opt.plan)
        assert shards == 7 and {s.daemon_index for s in opt.plan} == {0, 1}
        _train(opt, model, batches, loss_fn, clip=clip, dtype=dtype)
        stats = opt.audit.stats
    assert (stats.audited, stats.skipped, stats.mismatches) == (STEPS, 0, 0)
    assert stats.per_shard == {i: 2 if i < STEPS - shards else 1 for i in range(shards)}  # in turn, each shard


def test_audit_every_n_steps_only(daemons):
    model, batches, loss_fn = odd_case(STEPS)
    with trainer.offload(
        model,
        daemons=daemons,
        optimizer=trainer.AdamW(lr=3e-3),
        config=trainer.OffloadConfig(model_name="audit-every-3", shard_bytes=SHARD_BYTES, audit_every=3),
    ) as opt:
        _train(opt, model, batches, loss_fn, clip="none", dtype=torch.float32)
        stats = opt.audit.stats
    assert (stats.audited, stats.skipped, stats.mismatches) == (3, 0, 0)  # steps 0, 3, 6
    assert stats.per_shard == {0: 1, 1: 1, 2: 1}


def test_a_daemon_that_commits_a_wrong_update_is_caught(tmp_path):
    # Every shard the daemon steps at step 2 gets its first master value one ulp off.
    daemon = LocalDaemon(tmp_path / "faulty", env={PERTURB_STEP: "2", "OMP_NUM_THREADS": "1"})
    try:
        model, batches, loss_fn = odd_case(STEPS)
        reference = copy.deepcopy(model)
        # Without the audit the run goes on silently, and ends off torch.optim.
        silent = copy.deepcopy(model)
        with trainer.offload(
            silent, daemons=[daemon.address], optimizer=trainer.AdamW(lr=3e-3),
            config=trainer.OffloadConfig(model_name="unaudited", shard_bytes=SHARD_BYTES),
        ) as opt:  # fmt: skip
            _train(opt, silent, batches[:4], loss_fn, clip="none", dtype=torch.float32)
        torch_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True)
        torch_sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda step: 1.0 / (1 + step))
        for batch in batches[:4]:
            torch_opt.zero_grad()
            loss_fn(reference, batch).backward()
            torch_opt.step()
            torch_sched.step()
        assert not all(torch.equal(a, b) for a, b in zip(silent.parameters(), reference.parameters(), strict=True))

        with trainer.offload(
            model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=3e-3),
            config=trainer.OffloadConfig(model_name="audited", shard_bytes=SHARD_BYTES, audit_every=1),
        ) as opt:  # fmt: skip
            with pytest.raises(AuditMismatch) as info:
                _train(opt, model, batches, loss_fn, clip="none", dtype=torch.float32)
            stats = opt.audit.stats
            assert opt.step_count == 3  # the step happened on the daemon; the audit after it raised
    finally:
        daemon.kill()
    error = info.value
    assert (error.model, error.shard_id, error.step, error.tensor, error.differing) == ("audited", 2, 2, "master", 1)
    assert 0 < error.max_difference < 1e-6 and math.frexp(error.max_difference)[0] == 0.5  # one fp32 ulp
    message = str(error)
    for part in ("model 'audited'", "shard 2", "step 2", "master", "in 1 of 1024 elements", "max |difference|",
                 "first at shard element 0 (", "0 allowed (OffloadConfig.audit_tolerance)"):  # fmt: skip
        assert part in message, message
    assert (stats.audited, stats.skipped, stats.mismatches) == (3, 0, 1)
    assert stats.per_shard == {0: 1, 1: 1, 2: 1}


@pytest.mark.parametrize(
    ("optimizer", "settings", "message"),
    [
        (
            trainer.AdamW(),
            {"compression": trainer.CompressionConfig(method="bf16")},
            r"OffloadConfig.audit_every .* not with CompressionConfig\(method='bf16'\)",
        ),
        (
            trainer.AdamW(),
            {"compression": trainer.CompressionConfig(method="onebit", warmup_steps=2)},
            r"OffloadConfig.audit_every .* not with CompressionConfig\(method='onebit'\)",
        ),  # 1-bit Adam
        (
            trainer.SGD(),
            {"compression": trainer.CompressionConfig(method="topk")},
            r"OffloadConfig.audit_every .* not with CompressionConfig\(method='topk'\)",
        ),
    ],  # fmt: skip
)
def test_what_the_audit_cannot_recompute_is_refused_when_built(optimizer, settings, message, daemons):
    model, _, _ = odd_case(1)
    config = trainer.OffloadConfig(model_name="audit-refused", audit_every=10)
    with pytest.raises(ValueError, match=message):
        trainer.offload(model, daemons=daemons, optimizer=optimizer, config=config, **settings)


def test_the_delayed_update_is_refused_in_the_config():
    with pytest.raises(ValueError, match="OffloadConfig.audit_every needs staleness=0"):
        trainer.OffloadConfig(audit_every=10, staleness=1)


def test_a_streamed_model_refuses_the_audit_instead_of_ignoring_it(daemons):
    model, _, _ = odd_case(1)
    config = trainer.OffloadConfig(model_name="audit-streamed", audit_every=10)
    with pytest.raises(ValueError, match="audit_every is not run for streamed models"):
        trainer.offload(model, daemons=daemons, optimizer=trainer.AdamW(), config=config,
                        stream=trainer.Streaming(blocks=[model]))  # fmt: skip


def test_with_replicas_every_holder_is_audited_and_a_diverged_replica_is_caught(tmp_path):
    """OffloadConfig(replicas=2): each audit reads the shard from every holder. A holder whose
    update is off (daemon 1, one ulp at step 0, every shard it steps) is named, whichever of
    a shard's holders it is; honest replicas pass."""
    honest = [LocalDaemon(tmp_path / f"d{i}", env={"OMP_NUM_THREADS": "1"}) for i in (0, 2)]
    faulty = LocalDaemon(tmp_path / "d1", env={PERTURB_STEP: "0", "OMP_NUM_THREADS": "1"})
    daemons = [honest[0], faulty, honest[1]]
    try:
        model, batches, loss_fn = odd_case(STEPS)
        with trainer.offload(
            model, daemons=[d.address for d in daemons], optimizer=trainer.AdamW(lr=3e-3),
            config=trainer.OffloadConfig(model_name="audit-replicas", shard_bytes=SHARD_BYTES, audit_every=1,
                                         replicas=2),
        ) as opt:  # fmt: skip
            audited = opt.audit.shards  # in turn: step k audits audited[k % len]
            first = next(k for k, s in enumerate(audited) if 1 in s.holders)
            with pytest.raises(AuditMismatch) as info:
                _train(opt, model, batches, loss_fn, clip="none", dtype=torch.float32)
            stats = opt.audit.stats
    finally:
        for daemon in daemons:
            daemon.kill()
    error, message = info.value, str(info.value)
    assert error.shard_id == audited[first].shard_id and stats.mismatches == 1, message
    assert faulty.address in message
    if first == 0:  # its commit of step 0 is off torch's
        assert "differs from torch.optim's in-process update" in message and error.step == 0
    else:  # caught before the step: the replicas' state at version `first` differ
        assert "the replicas' master before the step differ" in message and error.step == first
    assert stats.audited == first + (first == 0) and 1 in audited[first].holders


def test_parameters_changed_in_place_behind_the_optimizer_are_caught(daemons):
    """The trainer's compute copy of the audited shard must be the daemons' master rounded to
    the compute dtype: a value changed in place after offload() (no new tensor, so nothing else
    sees it) makes the step's gradient one the daemons never had the parameters for."""
    model, batches, loss_fn = odd_case(STEPS)
    with trainer.offload(
        model, daemons=daemons, optimizer=trainer.AdamW(lr=3e-3),
        config=trainer.OffloadConfig(model_name="audit-in-place", shard_bytes=SHARD_BYTES, audit_every=1),
    ) as opt:  # fmt: skip
        _train(opt, model, batches[:2], loss_fn, clip="none", dtype=torch.float32)
        shard = opt.audit.shards[opt.audit._turn % len(opt.audit.shards)]  # the next step's
        with torch.no_grad():
            opt.flat.values[shard.offset + 3] += 1.0
        x, y = batches[2]
        loss_fn(model, (x, y)).backward()
        with pytest.raises(AuditMismatch, match="the trainer's parameters differ from the daemons' master") as info:
            opt.step()
        assert opt.step_count == 2  # refused before the step's pushes
    assert info.value.shard_id == shard.shard_id and info.value.differing == 1
    assert "Nothing of this step was pushed" in str(info.value)
