"""Compressed gradient pushes end to end, through real daemons: training converges, the bytes
on the wire shrink as the encodings promise, and a run with a daemon killed twice ends bit
for bit where an uninterrupted one does (each (shard, step) is compressed once and resent
as is, so error feedback survives the retries)."""

from __future__ import annotations

import copy
import math
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import trainer
from ps_daemon.encodings import onebit_nbytes
from ps_daemon.local import LocalDaemon
from trainer.debug_models import CharDataset, GPTConfig, TinyGPT, mlp

CORPUS = Path(__file__).resolve().parents[2] / "examples" / "data" / "corpus.txt"
# The demo's char GPT, smaller (0.11M parameters) so that four runs take well under a minute.
STEPS, WARMUP, BATCH = 200, 20, 16
CONFIG = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)
SHARD_BYTES = 64 << 10  # 16384 elements: several shards, the last one partial


def _lr(step: int, peak: float = 3e-3) -> float:
    """examples/train_gpt.py's schedule: linear warm-up over 20 steps, cosine to 10%."""
    if step < 20:
        return peak * (step + 1) / 20
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 20) / (STEPS - 20))))


def _train_gpt(address: str, compression: str, **options) -> dict:
    torch.manual_seed(0)
    data = CharDataset(CORPUS.read_text(), CONFIG["block_size"], seed=0)  # the same batches every run
    model = TinyGPT(GPTConfig(vocab_size=data.vocab_size, **CONFIG))
    losses, bytes_at = [], []
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
            bytes_at.append(opt.bytes_pushed)
        plan = opt.plan
    return {"losses": losses, "bytes": bytes_at, "plan": plan, "numel": sum(p.numel() for p in model.parameters())}


def _final(losses: list[float]) -> float:
    return sum(losses[-20:]) / 20  # one step's loss is noisy


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    daemon = LocalDaemon(tmp_path_factory.mktemp("daemon"))
    try:
        return {
            "none": _train_gpt(daemon.address, "none"),
            "bf16": _train_gpt(daemon.address, "bf16", compression_warmup_steps=WARMUP),
            "onebit": _train_gpt(daemon.address, "onebit", compression_warmup_steps=WARMUP),
            "topk": _train_gpt(daemon.address, "topk", compression_warmup_steps=WARMUP),  # 1% of each block
        }
    finally:
        daemon.kill()


def test_bf16_ends_within_3_percent_of_uncompressed(runs):
    baseline, ours = _final(runs["none"]["losses"]), _final(runs["bf16"]["losses"])
    assert ours <= 1.03 * baseline, f"bf16 {ours:.4f} vs fp32 {baseline:.4f}"


def test_onebit_after_warm_up_keeps_learning_close_to_uncompressed(runs):
    """1-bit signs with error feedback, AdamW on the daemon. Measured on this model: 2.207
    against 1.997 uncompressed after 200 steps (+10.5%; +22% on the 0.81M-parameter demo
    GPT). The signs' noise enters m, and v follows the block scales rather than each
    element's own gradient. 3% is not reached; the 20% bound guards against regressions."""
    baseline, onebit = runs["none"]["losses"], runs["onebit"]["losses"]
    at_switch = sum(onebit[WARMUP - 10 : WARMUP]) / 10
    assert onebit[:WARMUP] == baseline[:WARMUP]  # warm-up steps are plain fp32, the same run
    assert _final(onebit) < at_switch - 0.4, f"stopped learning after the warm-up: {_final(onebit):.3f}"
    assert _final(onebit) <= 1.2 * _final(baseline), f"onebit {_final(onebit):.4f} vs fp32 {_final(baseline):.4f}"


def test_bf16_and_topk_losses_fall(runs):
    for name in ("bf16", "topk"):
        losses = runs[name]["losses"]
        assert _final(losses) < sum(losses[:20]) / 20 - 1.0, name
        assert _final(losses) < sum(losses[WARMUP - 10 : WARMUP]) / 10 - 0.3, name  # also after the switch


def test_onebit_pushes_at_least_20x_fewer_bytes_than_fp32(runs):
    run = runs["onebit"]
    fp32_step = 4 * run["numel"]
    per_step = [b - a for a, b in zip(run["bytes"], run["bytes"][1:], strict=False)]
    assert run["bytes"][0] == fp32_step and set(per_step[: WARMUP - 1]) == {fp32_step}  # warm-up: raw fp32
    compressed = per_step[WARMUP - 1 :]
    expected = sum(onebit_nbytes(s.numel) for s in run["plan"])
    assert set(compressed) == {expected}, "every compressed step pushes every shard's signs and scales once"
    assert fp32_step / expected >= 20, f"only {fp32_step / expected:.1f}x fewer bytes"
    assert runs["none"]["bytes"][-1] == STEPS * fp32_step


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


def test_onebit_with_the_delayed_update_trains(daemon):
    model, batches = _mlp_case(steps=60)
    losses = _train_mlp(model, batches, daemon.address, staleness=1)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.3
