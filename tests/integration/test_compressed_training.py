"""Compressed pushes end to end, through real daemons: 1-bit Adam trains the demo model as well
as fp32 does with 20x fewer bytes on the wire (counted by the daemon), bf16 and top-k train,
a 1-bit Adam trainer resumes its momentum from the daemons, and a run with a daemon killed
twice ends bit for bit where an uninterrupted one does (each (shard, step) is compressed once
and resent as is, so error feedback and the momentum survive the retries)."""

from __future__ import annotations

import copy
import math
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from ps_offload import trainer
from ps_offload.daemon.encodings import onebit_nbytes
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.trainer.debug_models import CharDataset, GPTConfig, TinyGPT, mlp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import train_gpt  # noqa: E402

CORPUS = ROOT / "examples" / "data" / "corpus.txt"
DEMO_WARMUP = 60  # 1-bit Adam's warm-up: a fifth of the demo's 300 steps


def _admin(address: str):
    return ps_pb2_grpc.AdminStub(grpc.insecure_channel(address))


def _bytes_pushed(address: str) -> int:
    return _admin(address).Stats(ps_pb2.StatsRequest(), timeout=30).bytes_pushed


def _demo(address: str, compression: str) -> dict:
    """examples/train_gpt.py as the demo runs it (0.81M-parameter char GPT, 300 steps),
    with the daemon's count of the payload bytes it took in."""
    argv = ["--daemons", address, "--model-name", compression, "--sample", "0", "--compression", compression]
    if compression != "none":
        argv += ["--compression-warmup-steps", str(DEMO_WARMUP)]
    before = _bytes_pushed(address)
    losses = train_gpt.train(train_gpt.parse_args(argv))
    shards = _admin(address).ListShards(ps_pb2.ListShardsRequest(model=compression), timeout=30).shards
    return {"losses": losses, "bytes": _bytes_pushed(address) - before, "numels": [s.numel for s in shards]}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, dict]:
    daemon = LocalDaemon(tmp_path_factory.mktemp("daemon"))
    try:
        return {name: _demo(daemon.address, name) for name in ("none", "onebit")}
    finally:
        daemon.kill()


def _final(losses: list[float]) -> float:
    return sum(losses[-20:]) / 20  # one step's loss is noisy


def test_one_bit_adam_after_warm_up_ends_within_3_percent_of_uncompressed_on_the_demo_model(demo):
    """Measured here: 1.395 against 1.424 uncompressed after 300 steps (2% lower). Compressing
    the gradient instead and letting v follow it ended 40% higher (docs/architecture.md)."""
    baseline, onebit = demo["none"]["losses"], demo["onebit"]["losses"]
    assert onebit[:DEMO_WARMUP] == baseline[:DEMO_WARMUP]  # warm-up steps are plain AdamW, the same run
    assert _final(onebit) <= 1.03 * _final(baseline), f"onebit {_final(onebit):.4f} vs fp32 {_final(baseline):.4f}"
    assert _final(onebit) < sum(onebit[DEMO_WARMUP - 10 : DEMO_WARMUP]) / 10 - 0.5  # and learned after the switch


def test_one_bit_adam_pushes_at_least_20x_fewer_bytes_than_fp32(demo):
    numel = sum(demo["none"]["numels"])
    assert demo["none"]["bytes"] == 4 * numel * 301  # initial values + 300 fp32 gradients
    compressed = demo["onebit"]["bytes"] - 4 * numel * (1 + DEMO_WARMUP)
    per_step = onebit_nbytes_of(demo["onebit"]["numels"])
    assert compressed == per_step * (300 - DEMO_WARMUP), "every compressed step sends each shard's signs once"
    assert 4 * numel / per_step >= 20, f"only {4 * numel / per_step:.1f}x fewer bytes"


def onebit_nbytes_of(numels: list[int]) -> int:
    return sum(onebit_nbytes(n) for n in numels)


# --- bf16 and top-k on a smaller GPT (0.11M parameters), where four runs take seconds ----

STEPS, WARMUP, BATCH = 200, 20, 16
CONFIG = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)
SHARD_BYTES = 64 << 10  # 16384 elements: several shards, the last one partial


def _lr(step: int, peak: float = 3e-3) -> float:
    """examples/train_gpt.py's schedule: linear warm-up over 20 steps, cosine to 10%."""
    if step < 20:
        return peak * (step + 1) / 20
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 20) / (STEPS - 20))))


def _train_gpt(address: str, compression: str, **options) -> list[float]:
    torch.manual_seed(0)
    data = CharDataset(CORPUS.read_text(), CONFIG["block_size"], seed=0)  # the same batches every run
    model = TinyGPT(GPTConfig(vocab_size=data.vocab_size, **CONFIG))
    losses = []
    with trainer.offload(
        model, daemons=[address], optimizer=trainer.AdamW(lr=3e-3, weight_decay=0.1), model_name=compression,
        shard_bytes=SHARD_BYTES, no_weight_decay=lambda name, p: p.dim() < 2, compression=compression, **options,
    ) as opt:  # fmt: skip
        for step in range(STEPS):
            opt.lr = _lr(step)
            x, y = data.batch(BATCH)
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[float]]:
    daemon = LocalDaemon(tmp_path_factory.mktemp("daemon"))
    try:
        return {
            "none": _train_gpt(daemon.address, "none"),
            "bf16": _train_gpt(daemon.address, "bf16", compression_warmup_steps=WARMUP),
            "topk": _train_gpt(daemon.address, "topk", compression_warmup_steps=WARMUP),  # 1% of each block
        }
    finally:
        daemon.kill()


def test_bf16_ends_within_3_percent_of_uncompressed(runs):
    baseline, ours = _final(runs["none"]), _final(runs["bf16"])
    assert ours <= 1.03 * baseline, f"bf16 {ours:.4f} vs fp32 {baseline:.4f}"


def test_bf16_and_topk_losses_fall(runs):
    for name in ("bf16", "topk"):
        losses = runs[name]
        assert _final(losses) < sum(losses[:20]) / 20 - 1.0, name
        assert _final(losses) < sum(losses[WARMUP - 10 : WARMUP]) / 10 - 0.3, name  # also after the switch


def _mlp_case(steps=24):
    torch.manual_seed(0)
    model = mlp((32, 64, 64, 10))
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 10, generator=g)
    inputs = [torch.randn(16, 32, generator=g) for _ in range(steps)]
    return model, [(x, (x @ teacher).argmax(dim=1)) for x in inputs]


def _train_mlp(model, batches, address, *, staleness=0, kill=None):
    config = trainer.ClientConfig(max_attempts=12, backoff_seconds=0.05)
    losses = []
    with trainer.offload(
        model, daemons=[address], optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1), shard_bytes=8192,
        compression="onebit", compression_warmup_steps=3, staleness=staleness, config=config,
    ) as opt:  # fmt: skip
        killer = threading.Thread(target=kill, args=(opt,)) if kill else None
        if killer:
            killer.start()
        for x, y in batches:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        opt.synchronize()
        if killer:
            killer.join(60)
    return losses


def test_onebit_through_sigkill_ends_bit_identical_to_an_uninterrupted_run(daemon_factory, tmp_path):
    """The daemon (NVMe tier) is SIGKILLed twice mid-run and restarted on the same port; the
    trainer's retries resend the kept payloads. Fused 1-bit steps, version rules and commits
    must all hold for the run to end exactly where an uninterrupted one does."""
    model, batches = _mlp_case()
    uninterrupted = copy.deepcopy(model)
    _train_mlp(uninterrupted, batches, daemon_factory().address)

    nvme = str(tmp_path / "nvme")
    daemons = [daemon_factory("--nvme-dir", nvme)]
    port, kills = daemons[0].port, []

    def kill(opt):
        for when in (6, 15):
            while opt.step_count < when:
                time.sleep(0.001)
            daemons[-1].process.send_signal(signal.SIGKILL)
            daemons[-1].process.wait()
            kills.append(opt.step_count)
            daemons.append(daemon_factory("--nvme-dir", nvme, "--listen", f"127.0.0.1:{port}"))

    _train_mlp(model, batches, daemons[0].address, kill=kill)
    assert len(kills) == 2
    for (name, ours), theirs in zip(model.named_parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(ours, theirs), f"{name}: max |diff| {(ours - theirs).abs().max().item()}"


def test_one_bit_adam_with_the_delayed_update_trains(daemon):
    """staleness=1 and 1-bit Adam together on the small GPT (measured: 3.02 at the switch,
    2.36 after 200 steps)."""
    losses = _train_gpt(daemon.address, "onebit", compression_warmup_steps=40, staleness=1)
    assert _final(losses) < sum(losses[30:40]) / 10 - 0.3


def test_a_resumed_one_bit_adam_trainer_takes_its_momentum_from_the_daemons(daemon_factory):
    """After compressed steps the trainer's momentum is the decompressed one the daemons
    stored as exp_avg; a trainer re-created under the same name must go on from exactly that
    (not from zero), over both transports' pull of EXP_AVG."""
    for transport in ("grpc", "auto"):
        model, batches = _mlp_case(steps=8)
        address = daemon_factory().address
        options = dict(
            daemons=[address], optimizer=trainer.AdamW(lr=1e-2), shard_bytes=8192, model_name="resume",
            compression="onebit", compression_warmup_steps=3, config=trainer.ClientConfig(transport=transport),
        )  # fmt: skip
        with trainer.offload(model, **options) as opt:
            for x, y in batches:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            opt.synchronize()
            momentum = opt._compressor.momentum.clone()
            variance = torch.empty_like(momentum)
            for shard in opt.plan:
                into = memoryview(variance[shard.offset : shard.end].numpy()).cast("B")
                opt.client.pull(shard, min_version=0, out=into, tensor=ps_pb2.EXP_AVG_SQ)
        assert momentum.any() and (variance == 0).any() and (variance > 0).any()
        # The daemons hold the trainer's momentum, but for elements without a preconditioner
        # (no gradient in the warm-up: dead ReLU units here), which they do not move.
        expected = torch.where(variance > 0, momentum, 0.0)
        with trainer.offload(copy.deepcopy(model), **options) as resumed:
            assert resumed.step_count == len(batches)
            assert torch.equal(resumed._compressor.momentum, expected), transport
