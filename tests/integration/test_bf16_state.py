"""OffloadConfig(state_dtype="bfloat16"): the daemons keep master values, m and v in bf16 and
a bf16 model trains through them bit for bit as torch.optim.AdamW(fused=True) trains the bf16
parameters themselves in one process (what torchao's CPU
offload keeps for a bf16 model), with half the state bytes of the fp32 default; the
refusals say why, before anything changes.
"""

from __future__ import annotations

import copy

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.trainer.debug_models import mlp

STEPS = 6
LR = 1e-2


def _case(widths=(33, 129, 17, 10), steps=STEPS):
    torch.manual_seed(0)
    model = mlp(widths).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(widths[0], widths[-1], generator=g)
    inputs = [torch.randn(16, widths[0], generator=g) for _ in range(steps)]
    return model, [(x.to(torch.bfloat16), (x @ teacher).argmax(dim=1)) for x in inputs]


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def _no_decay(name, p):
    return p.dim() < 2


def _torch_optimizer(model):
    decay = [p for n, p in model.named_parameters() if not _no_decay(n, p)]
    no_decay = [p for n, p in model.named_parameters() if _no_decay(n, p)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, fused=True)


def _ours():
    return trainer.AdamW(lr=LR, weight_decay=0.1)


def _train(model, batches, opt, *, clip: bool):
    for batch in batches:
        opt.zero_grad()
        _loss(model, batch).backward()
        if clip:  # bf16 gradients clipped in place, as a user's script does
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()


def _pulled(opt, tensor: int) -> list[torch.Tensor]:
    """A state tensor of every parameter as the daemons hold it, pulled as float32 (widened)."""
    flat = torch.empty(opt.flat.numel, dtype=torch.float32)
    view = memoryview(flat.numpy()).cast("B")
    for shard in opt.plan:
        opt.client.pull(shard, min_version=0, out=view[shard.offset * 4 : shard.end * 4], tensor=tensor)
    ranges = [opt.flat.param_range(i) for i in range(len(opt.params))]
    return [flat[a:b].view(p.shape) for p, (a, b) in zip(opt.params, ranges, strict=True)]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(
    ("n_daemons", "shard_bytes", "staging", "clip"),
    [(1, 4096, "auto", True), (2, 8192, "auto", False), (2, 4096, "always", True)],
    ids=["1-daemon-4k-clip", "2-daemons-8k", "2-daemons-4k-staged-clip"],
)
def test_bf16_state_equals_torch_optim_on_the_bf16_parameters(n_daemons, shard_bytes, staging, clip, daemon_factory):
    model, batches = _case()
    reference = copy.deepcopy(model)
    torch_opt = _torch_optimizer(reference)
    _train(reference, batches, torch_opt, clip=clip)

    daemons = daemon_factory.together([()] * n_daemons)
    with trainer.offload(
        model,
        daemons=[d.address for d in daemons],
        optimizer=_ours(),
        no_weight_decay=_no_decay,
        config=trainer.OffloadConfig(shard_bytes=shard_bytes, state_dtype="bfloat16", audit_every=1),
        device=trainer.DeviceConfig(staging=staging, host_buffers=2),
    ) as opt:
        assert len(opt.plan) >= 2 * n_daemons  # shards cut through parameters
        _train(model, batches, opt, clip=clip)
        assert opt.audit.stats.audited == STEPS and opt.audit.stats.mismatches == 0  # recomputed in bf16
        for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert _same_bits(ours.detach(), theirs.detach()), name
        # The daemons' master is the bf16 parameter (widened exactly when pulled as float32),
        # and their state is torch's, bit for bit.
        for ours, theirs in zip(_pulled(opt, ps_pb2.MASTER), reference.parameters(), strict=True):
            assert torch.equal(ours, theirs.detach().float())
        for index, name in enumerate(["exp_avg", "exp_avg_sq"]):
            pulled = _pulled(opt, ps_pb2.EXP_AVG + index)
            for ours, p in zip(pulled, reference.parameters(), strict=True):
                theirs = torch_opt.state[p][name]
                assert theirs.dtype == torch.bfloat16
                assert torch.equal(ours, theirs.float()), name


def test_bf16_state_with_the_optimizers_clip_equals_torchs_clip(daemon_factory):
    """opt.clip_grad_norm_ leaves the multiplication to the daemon; with bf16 state it rounds the
    clipped gradient to bf16 as torch's clip does in place (an fp32 product, rounded), so the
    pushes made during backward stay exact."""
    model, batches = _case()
    reference = copy.deepcopy(model)
    _train(reference, batches, _torch_optimizer(reference), clip=True)
    daemon = daemon_factory()
    with trainer.offload(
        model, daemons=[daemon.address], optimizer=_ours(), no_weight_decay=_no_decay,
        config=trainer.OffloadConfig(shard_bytes=4096, state_dtype="bfloat16", push_in_backward=True),
    ) as opt:  # fmt: skip
        norms = []
        for batch in batches:
            opt.zero_grad()
            _loss(model, batch).backward()
            norms.append(float(opt.clip_grad_norm_(0.5)))
            opt.step()
        opt.synchronize()
    assert max(norms) > 0.5  # the clip fired
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert _same_bits(ours.detach(), theirs.detach())


def _ram_bytes_used(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10).ram_bytes_used


def test_bf16_state_holds_half_the_bytes_of_fp32_state(daemon_factory):
    held = {}
    for state_dtype in ("float32", "bfloat16"):
        model, _ = _case(widths=(256, 512, 256))
        daemon = daemon_factory()
        with trainer.offload(
            model, daemons=[daemon.address], optimizer=trainer.AdamW(lr=LR),
            config=trainer.OffloadConfig(shard_bytes=1 << 20, state_dtype=state_dtype),
        ):  # fmt: skip
            held[state_dtype] = _ram_bytes_used(daemon.address)
    # Master, m and v: 12 bytes a parameter against 6 (and the arenas' page rounding).
    assert held["float32"] >= 12 * 262_912
    assert abs(2 * held["bfloat16"] - held["float32"]) <= 2 * 4 * 4096


def test_bf16_state_survives_a_restart_on_nvme(tmp_path):
    """Committed to disk in bf16 and recovered: the restarted daemon resumes the run exactly."""
    nvme = tmp_path / "nvme"
    model, batches = _case(steps=8)
    reference = copy.deepcopy(model)
    _train(reference, batches, _torch_optimizer(reference), clip=True)
    first = LocalDaemon(tmp_path / "a", "--nvme-dir", str(nvme))
    try:
        with trainer.offload(
            model, daemons=[first.address], optimizer=_ours(), no_weight_decay=_no_decay,
            config=trainer.OffloadConfig(shard_bytes=4096, state_dtype="bfloat16"),
        ) as opt:  # fmt: skip
            _train(model, batches[:4], opt, clip=True)
        assert first.stop() == 0
    finally:
        first.kill()
    second = LocalDaemon(
        tmp_path / "b", "--nvme-dir", str(nvme), "--ram-bytes", str(16 << 10)
    )  # 2 of its 7 shards: the rest read from disk
    try:
        resumed, _ = _case(steps=8)  # fresh values: the recovered ones replace them
        with trainer.offload(
            resumed, daemons=[second.address], optimizer=_ours(), no_weight_decay=_no_decay,
            config=trainer.OffloadConfig(shard_bytes=4096, state_dtype="bfloat16"),
        ) as opt:  # fmt: skip
            assert opt.step_count == 4
            _train(resumed, batches[4:], opt, clip=True)
            with grpc.insecure_channel(second.address) as channel:
                stats = ps_pb2_grpc.AdminStub(channel).Stats(ps_pb2.StatsRequest(), timeout=10)
            assert stats.nvme_master_reads > 0 and stats.tier_misses > 0  # bf16 arenas and masters read back
        for ours, theirs in zip(resumed.parameters(), reference.parameters(), strict=True):
            assert _same_bits(ours.detach(), theirs.detach())
    finally:
        second.kill()


def test_bf16_state_of_an_fp32_model_is_refused_before_registering():
    with pytest.raises(ValueError, match=r"model's parameters are torch.float32: cast the model"):
        trainer.offload(
            mlp((8, 8, 4)), daemons=["127.0.0.1:1"], optimizer=trainer.AdamW(),
            config=trainer.OffloadConfig(state_dtype="bfloat16"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="state_dtype must be one of 'float32', 'bfloat16', got 'float16'"):
        trainer.OffloadConfig(state_dtype="float16")
    with pytest.raises(ValueError, match="state_dtype='bfloat16' is not one sgd keeps"):
        trainer.offload(
            mlp((8, 8, 4)).to(torch.bfloat16), daemons=["127.0.0.1:1"], optimizer=trainer.SGD(momentum=0.9),
            config=trainer.OffloadConfig(state_dtype="bfloat16"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="1-bit Adam"):
        trainer.offload(
            mlp((8, 8, 4)).to(torch.bfloat16), daemons=["127.0.0.1:1"], optimizer=trainer.AdamW(),
            config=trainer.OffloadConfig(state_dtype="bfloat16"),
            compression=trainer.CompressionConfig(method="onebit", warmup_steps=2),
        )  # fmt: skip


def _register(address: str, spec: ps_pb2.ModelSpec) -> ps_pb2.RegisterModelResponse:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.ParameterServerStub(channel).RegisterModel(
            ps_pb2.RegisterModelRequest(spec=spec, daemon_index=0), timeout=30
        )


def _spec(address: str, *, param_dtype=ps_pb2.BFLOAT16, state_dtype=ps_pb2.BFLOAT16, sgd=False) -> ps_pb2.ModelSpec:
    optimizer = (
        ps_pb2.OptimizerSpec(sgd=ps_pb2.SGDSpec(lr=1e-3, momentum=0.9))
        if sgd
        else ps_pb2.OptimizerSpec(adamw=ps_pb2.AdamWSpec(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8))
    )
    spec = ps_pb2.ModelSpec(
        model="m", shard_bytes=4096, daemons=[address], state_dtype=state_dtype, optimizer=optimizer
    )  # fmt: skip
    spec.params.add(name="w", shape=[100], dtype=param_dtype)
    spec.params.add(name="b", shape=[3], dtype=ps_pb2.BFLOAT16)
    return spec


def test_the_daemon_refuses_a_state_dtype_it_cannot_keep_exactly(daemon):
    for spec, message in [
        (_spec(daemon.address, param_dtype=ps_pb2.FLOAT32), "every parameter must be bfloat16; 'w' is float32"),
        (_spec(daemon.address, state_dtype=ps_pb2.FLOAT16), "state_dtype 'float16' is not supported"),
        (_spec(daemon.address, state_dtype=77), "state_dtype 77 is unknown"),
        (
            _spec(daemon.address, sgd=True),
            "state_dtype bfloat16 is not one sgd keeps (float32): torch's fused CPU SGD leaves bf16",
        ),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            _register(daemon.address, spec)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()
    response = _register(daemon.address, _spec(daemon.address))
    assert response.created and response.state_dtype == ps_pb2.BFLOAT16
    # The same model again with fp32 state is another model: refused, the first kept.
    with pytest.raises(grpc.RpcError) as caught:
        _register(daemon.address, _spec(daemon.address, state_dtype=ps_pb2.FLOAT32))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "state_dtype was bfloat16, now float32" in caught.value.details()
    assert not _register(daemon.address, _spec(daemon.address)).created


def test_a_daemon_that_ignores_state_dtype_is_refused_by_the_trainer():
    """A daemon from before the field keeps fp32 state and says nothing: its silence is read."""
    from ps_offload.trainer.wire.daemon_client import check_state_dtype_echo

    spec = ps_pb2.ModelSpec(model="m", state_dtype=ps_pb2.BFLOAT16)
    old = ps_pb2.RegisterModelResponse(daemon_version="0.3.0", protocol=2)  # state_dtype unset
    with pytest.raises(RuntimeError, match=r"keeps model 'm' in FLOAT32 state, the trainer asked for BFLOAT16"):
        check_state_dtype_echo("127.0.0.1:1", spec, old)
    check_state_dtype_echo("127.0.0.1:1", ps_pb2.ModelSpec(model="m"), old)  # fp32 state: any daemon
    check_state_dtype_echo("127.0.0.1:1", spec, ps_pb2.RegisterModelResponse(state_dtype=ps_pb2.BFLOAT16))
