"""Compressed pushes end to end, through real daemons, on a small MLP over a few steps each:
bf16, top-k and 1-bit Adam (also with the delayed update) end bit for bit where an in-process
run of the same compression does (the trainer's compressor, its payloads decoded here, torch's
fused AdamW, and for 1-bit Adam's momentum pushes the fused kernel the daemons run); their
warm-up steps are plain AdamW; the daemon counts exactly the bytes each encoding sends (1-bit:
20x fewer than fp32 and more); a 1-bit Adam trainer resumes its momentum from the daemons; and
a run with a daemon killed twice ends bit for bit where an uninterrupted one does (each
(shard, step) is compressed once and resent as is, so error feedback and the momentum survive
the retries).

How well each compression trains (1-bit Adam's loss after the demo's 300 steps, within 3% of
fp32's) is a measurement, made by bench/compression_convergence.py, not a test."""

from __future__ import annotations

import copy
import signal
import threading
from dataclasses import dataclass

import grpc
import pytest
import torch
from torch import nn

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.kernels import BLOCK, topk_count
from ps_offload.kernels.fused_adamw import onebit_adam_
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.payloads import onebit_nbytes
from ps_offload.proto.push import Push
from ps_offload.trainer.config import CompressionConfig, OffloadConfig
from ps_offload.trainer.debug_models import mlp
from ps_offload.trainer.io.push_compression import Payload, PushCompressor

STEPS, WARMUP = 12, 4
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.999), 1e-8
TOPK_RATIO = 0.05
SHARD_BYTES = 8192  # 2048 elements: four shards of the MLP's 6922, pieces of several parameters, the last partial


def _no_weight_decay(name: str, p: nn.Parameter) -> bool:
    return p.dim() < 2  # biases: a second decay group on the daemons


def _admin(address: str):
    return ps_pb2_grpc.AdminStub(grpc.insecure_channel(address))


def _bytes_pushed(address: str) -> int:
    return _admin(address).Stats(ps_pb2.StatsRequest(), timeout=30).bytes_pushed


def _mlp_case(steps: int = STEPS):
    torch.manual_seed(0)
    model = mlp((32, 64, 64, 10))
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 10, generator=g)
    inputs = [torch.randn(16, 32, generator=g) for _ in range(steps)]
    return model, [(x, (x @ teacher).argmax(dim=1)) for x in inputs]


def _offload(model, address, name, compression, *, staleness=0, client=None):
    return trainer.offload(
        model, daemons=[address], optimizer=trainer.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
        no_weight_decay=_no_weight_decay, client=client,
        config=OffloadConfig(model_name=name, shard_bytes=SHARD_BYTES, staleness=staleness),
        compression=CompressionConfig(method=compression, warmup_steps=WARMUP, topk_ratio=TOPK_RATIO),
    )  # fmt: skip


@dataclass
class Run:
    losses: list[float]
    params: list[torch.Tensor]
    daemon_bytes: int  # what the daemon counted, the initial values included
    trainer_bytes: int  # opt.bytes_pushed: the gradient pushes
    plan: list


def _train(model, batches, address, name, compression, *, staleness=0, client=None, after_step=None) -> Run:
    before = _bytes_pushed(address)
    losses = []
    with _offload(model, address, name, compression, staleness=staleness, client=client) as opt:
        for x, y in batches:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if after_step is not None:
                after_step(opt)
        opt.synchronize()
        trainer_bytes, plan = opt.bytes_pushed, opt.plan
    params = [p.detach().clone() for p in model.parameters()]
    return Run(losses, params, _bytes_pushed(address) - before, trainer_bytes, plan)


# --- the in-process reference -------------------------------------------------------------


def _pushed(compressor: PushCompressor, shard, step: int, grads: torch.Tensor) -> Payload:
    """What the trainer pushes: the compressed payload, or (None: a warm-up step) the fp32
    gradient as it is."""
    payload = compressor.payload(shard, step, grads)
    if payload is None:
        payload = Payload(ps_pb2.RAW, memoryview(grads[shard.offset : shard.end].numpy()).cast("B"))
    return payload


def _decode(payload, numel: int) -> torch.Tensor:
    """A GRADIENT payload as fp32, read from the wire layout (proto/ps.proto)."""
    data = bytearray(payload.data)
    if payload.encoding == ps_pb2.RAW:
        return torch.frombuffer(data, dtype=torch.float32).clone()
    if payload.encoding == ps_pb2.BF16:
        return torch.frombuffer(data, dtype=torch.bfloat16).float()
    assert payload.encoding == ps_pb2.TOPK
    k = int.from_bytes(data[:4], "little")
    indices = torch.frombuffer(data, dtype=torch.int32, offset=4, count=k).long()
    values = torch.frombuffer(data, dtype=torch.float32, offset=4 + 4 * k, count=k)
    return torch.zeros(numel).index_put_((indices,), values)


def _reference(model, batches, plan, compression: str, *, staleness: int = 0) -> Run:
    """The same run in one process. Parameters live in one flat buffer laid out as the shard
    plan; each step's gradient goes through a PushCompressor as the trainer's does, shard by
    shard, and what its payloads say is applied: a GRADIENT by torch.optim.AdamW(fused=True),
    a MOMENTUM (1-bit Adam after the warm-up) by the fused 1-bit Adam kernel on the shard's
    slice of flat state (exp_avg_sq as the warm-up left it). staleness=1: step t's gradient
    is taken at the parameters of step t-1 (the first step's at the initial ones)."""
    params = list(model.parameters())
    numels = [p.numel() for p in params]
    offsets = [sum(numels[:i]) for i in range(len(params))]
    total = sum(numels)
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # the masters
    masters = [nn.Parameter(flat[o : o + n].view_as(p)) for p, o, n in zip(params, offsets, numels, strict=True)]
    decay = [0.0 if _no_weight_decay("", p) else WD for p in params]
    groups = [
        {"params": [m for m, d in zip(masters, decay, strict=True) if d == w], "weight_decay": w} for w in (WD, 0.0)
    ]
    adamw = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    compressor = PushCompressor(compression, total, warmup_steps=WARMUP, topk_ratio=TOPK_RATIO, adam_beta1=BETAS[0])
    exp_avg = exp_avg_sq = None  # flat, from the switch to 1-bit Adam on

    def pieces(shard) -> list[tuple[int, int, float]]:  # (start, end, decay) in shard coordinates
        return [
            (max(o, shard.offset) - shard.offset, min(o + n, shard.end) - shard.offset, d)
            for o, n, d in zip(offsets, numels, decay, strict=True)
            if o < shard.end and shard.offset < o + n
        ]

    losses, at = [], flat.clone()  # `at`: the parameters the gradient is taken at
    for step, (x, y) in enumerate(batches):
        with torch.no_grad():
            for p, o, n in zip(params, offsets, numels, strict=True):
                p.copy_(at[o : o + n].view_as(p))
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        payloads = [_pushed(compressor, shard, step, grads) for shard in plan]
        if staleness:
            at = flat.clone()
        if payloads[0].kind == ps_pb2.GRADIENT:
            decoded = torch.cat([_decode(pl, s.numel) for pl, s in zip(payloads, plan, strict=True)])
            for m, o, n in zip(masters, offsets, numels, strict=True):
                m.grad = decoded[o : o + n].view_as(m)
            adamw.step()
        else:
            if exp_avg is None:
                exp_avg = torch.zeros(total)
                exp_avg_sq = torch.cat([adamw.state[m]["exp_avg_sq"].reshape(-1) for m in masters])
            for payload, shard in zip(payloads, plan, strict=True):
                assert payload.encoding == ps_pb2.ONEBIT and payload.variance_frozen_at == WARMUP
                data, blocks = bytearray(payload.data), -(-shard.numel // BLOCK)
                scales = torch.frombuffer(data, dtype=torch.float32, count=blocks)
                bits = torch.frombuffer(data, dtype=torch.uint8, offset=4 * blocks)
                s = slice(shard.offset, shard.end)
                onebit_adam_(
                    flat[s], exp_avg[s], exp_avg_sq[s], bits, scales, segments=pieces(shard), step=step + 1,
                    variance_frozen_at=WARMUP, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                )  # fmt: skip
        if not staleness:
            at = flat.clone()
    return Run(losses, [m.detach().clone() for m in masters], 0, 0, plan)


# --- runs through the daemon --------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One daemon for the whole module (each run registers its own model)."""
    daemon = LocalDaemon(tmp_path_factory.mktemp("daemon"))
    try:
        yield daemon
    finally:
        daemon.kill()


@pytest.fixture(scope="module")
def runs(shared) -> dict[str, Run]:
    return {name: _train(*_mlp_case(), shared.address, name, name) for name in ("none", "bf16", "topk", "onebit")}


def _assert_same_params(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"parameter {i}: max |diff| {(a - b).abs().max().item()}"


@pytest.mark.parametrize("compression", ["bf16", "topk", "onebit"])
def test_compressed_run_ends_bit_identical_to_the_in_process_reference(runs, compression):
    ours = runs[compression]
    model, batches = _mlp_case()
    reference = _reference(model, batches, ours.plan, compression)
    assert ours.losses == reference.losses
    _assert_same_params(ours.params, reference.params)


def test_one_bit_adam_with_the_delayed_update_is_the_delayed_reference(shared):
    """staleness=1 and 1-bit Adam together: each step's momentum is taken at the parameters
    of the step before last, and still ends bit for bit where the in-process delayed run does."""
    model, batches = _mlp_case()
    ours = _train(model, batches, shared.address, "onebit-delayed", "onebit", staleness=1)
    reference = _reference(*_mlp_case(), ours.plan, "onebit", staleness=1)
    assert ours.losses == reference.losses
    _assert_same_params(ours.params, reference.params)


def test_warm_up_steps_are_plain_adamw_and_compression_starts_after_them(runs):
    baseline = runs["none"].losses
    for name in ("bf16", "topk", "onebit"):
        losses = runs[name].losses
        # The loss of step WARMUP is taken after WARMUP plain AdamW updates: still the same run.
        assert losses[: WARMUP + 1] == baseline[: WARMUP + 1], name
        assert losses[WARMUP + 1 :] != baseline[WARMUP + 1 :], name


def test_the_daemon_counts_each_encodings_bytes_and_one_bit_adam_sends_20x_fewer(runs):
    numels = [s.numel for s in runs["none"].plan]
    numel = sum(numels)
    assert runs["none"].daemon_bytes == 4 * numel * (1 + STEPS)  # initial values + fp32 gradients
    assert runs["none"].trainer_bytes == 4 * numel * STEPS
    plain = 4 * numel * (1 + WARMUP)  # initial values + the warm-up's fp32 gradients
    per_step = {
        "bf16": 2 * numel,
        "onebit": sum(onebit_nbytes(n) for n in numels),  # each shard's signs once per step
        "topk": sum(4 + 8 * topk_count(n, TOPK_RATIO) for n in numels),  # K, then K indices and values
    }
    for name, nbytes in per_step.items():
        assert runs[name].daemon_bytes == plain + nbytes * (STEPS - WARMUP), name
        assert runs[name].trainer_bytes == runs[name].daemon_bytes - 4 * numel, name
    assert 4 * numel / per_step["onebit"] >= 20, f"only {4 * numel / per_step['onebit']:.1f}x fewer bytes"


def test_a_resent_compressed_push_is_acknowledged_without_effect(shared):
    """A retry carries the kept payload of its (shard, step); the daemon, which applied it
    already, answers applied=False and moves neither the master nor exp_avg."""
    model, batches = _mlp_case(steps=WARMUP + 2)
    with _offload(model, shared.address, "resend", "onebit") as opt:
        for x, y in batches:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        opt.synchronize()
        step, numel = opt.step_count - 1, sum(s.numel for s in opt.plan)

        def state() -> list[torch.Tensor]:
            out = []
            for tensor in (ps_pb2.MASTER, ps_pb2.EXP_AVG):
                values = torch.empty(numel)
                for shard in opt.plan:
                    into = memoryview(values[shard.offset : shard.end].numpy()).cast("B")
                    assert opt.client.pull(shard, min_version=0, out=into, tensor=tensor) == step + 1
                out.append(values)
            return out

        before = state()
        for shard in opt.plan:
            kept = opt.io.compressor.payload(shard, step, torch.zeros(numel))  # kept, not compressed again
            assert kept.kind == ps_pb2.MOMENTUM
            ack = opt.client.push(
                shard,
                Push.unchecked(
                    opt.client.model,
                    shard.shard_id,
                    kept.data,
                    step=step,
                    kind=kept.kind,
                    lr=LR,
                    encoding=kept.encoding,
                    variance_frozen_at=kept.variance_frozen_at,
                ),
            )
            assert not ack.applied and ack.version == step + 1
        after = state()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(after[0], torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def test_onebit_through_sigkill_ends_bit_identical_to_an_uninterrupted_run(shared, daemon_factory, tmp_path):
    """The daemon (NVMe tier) is SIGKILLed twice mid-run, right after steps 6 and 15 were
    acknowledged (their pulls still in flight), and restarted on the same port while the
    trainer goes on; its retries resend the kept payloads. Fused 1-bit steps, version rules
    and commits must all hold for the run to end exactly where an uninterrupted one does."""
    model, batches = _mlp_case(steps=20)
    uninterrupted = _train(copy.deepcopy(model), batches, shared.address, "uninterrupted", "onebit")

    nvme = str(tmp_path / "nvme")
    daemons = [daemon_factory("--nvme-dir", nvme)]
    port, kills, restarts = daemons[0].port, [], []

    def restart() -> None:
        daemons.append(daemon_factory("--nvme-dir", nvme, "--listen", f"127.0.0.1:{port}"))

    def kill_after(opt) -> None:
        if opt.step_count in (6, 15):
            for thread in restarts:  # the previous restart is done (it was 9 steps ago)
                thread.join(60)
            daemons[-1].process.send_signal(signal.SIGKILL)
            daemons[-1].process.wait()
            kills.append(opt.step_count)
            # Restarted in the background: the next steps' calls retry until it listens.
            restarts.append(threading.Thread(target=restart))
            restarts[-1].start()

    client = trainer.ClientConfig(retry_seconds=60.0, backoff_seconds=0.05)  # retries span a restart at 1/4 speed
    ours = _train(model, batches, daemons[0].address, "killed", "onebit", client=client, after_step=kill_after)
    for thread in restarts:
        thread.join(60)
    assert kills == [6, 15] and len(daemons) == 3
    assert ours.losses == uninterrupted.losses
    _assert_same_params(ours.params, uninterrupted.params)


def test_a_resumed_one_bit_adam_trainer_takes_its_momentum_from_the_daemons(shared):
    """After compressed steps the trainer's momentum is the decompressed one the daemons
    stored as exp_avg; a trainer re-created under the same name must go on from exactly that
    (not from zero), over every transport's pull of EXP_AVG."""
    for transport in ("grpc", "tcp", "local"):
        model, batches = _mlp_case(steps=WARMUP + 3)
        name, client = f"resume-{transport}", trainer.ClientConfig(transport=transport)
        with _offload(model, shared.address, name, "onebit", client=client) as opt:
            for x, y in batches:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            opt.synchronize()
            momentum = opt.io.compressor.momentum.clone()
            variance = torch.empty_like(momentum)
            for shard in opt.plan:
                into = memoryview(variance[shard.offset : shard.end].numpy()).cast("B")
                opt.client.pull(shard, min_version=0, out=into, tensor=ps_pb2.EXP_AVG_SQ)
        assert momentum.any() and (variance == 0).any() and (variance > 0).any()
        # The daemons hold the trainer's momentum, but for elements without a preconditioner
        # (no gradient in the warm-up: dead ReLU units here), which they do not move.
        expected = torch.where(variance > 0, momentum, 0.0)
        with _offload(copy.deepcopy(model), shared.address, name, "onebit", client=client) as resumed:
            assert resumed.step_count == len(batches)
            assert torch.equal(resumed.io.compressor.momentum, expected), transport
