"""examples/hf_trainer.py: the Hugging Face Trainer fine-tunes a GPT-2 (tied embeddings) with the
offload optimizer and a transformers scheduler, saves a checkpoint, and a second run resumes
from it against the same daemon; the loss falls."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.site_first import site_packages_first

site_packages_first()  # before transformers looks for PyPI's `kernels`
pytest.importorskip("transformers", reason="transformers is in the dev extra")

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", ROOT / "examples" / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_trainer_trains_saves_and_resumes_through_a_daemon(daemon, tmp_path):
    example = _example()
    model = example.build_model()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one parameter to offload
    common = ["--daemons", daemon.address, "--output-dir", str(tmp_path / "run"), "--total-steps", "40",
              "--save-steps", "20", "--lr", "3e-3"]  # fmt: skip

    first = example.main([*common, "--steps", "20"])
    assert first["global_step"] == 20 and first["version"] == 20
    assert (tmp_path / "run" / "checkpoint-20" / "optimizer.pt").exists()

    resumed = example.main([*common, "--steps", "40", "--resume"])
    # The second run started at the checkpoint's step: 20 more steps, the daemons went on.
    assert resumed["global_step"] == 40 and resumed["version"] == 40
    # The Trainer restored the first run's log with the checkpoint and logged steps 25..40.
    assert resumed["history"][: len(first["history"])] == first["history"]
    assert [entry["step"] for entry in resumed["history"]] == [5, 10, 15, 20, 25, 30, 35, 40]
    losses = [entry["loss"] for entry in resumed["history"]]
    assert losses[-1] < losses[0] - 0.5, losses
    # The scheduler came back from the checkpoint too: cosine decay to zero at step 40.
    assert resumed["history"][-1]["learning_rate"] < first["history"][-1]["learning_rate"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_trainer_under_torchrun_with_two_processes_matches_torch_adamw(daemon, tmp_path):
    """The Trainer moves the model (`model.to(device)`) after the optimizer was built and wraps it
    in DDP: the offload optimizer adopts the moved parameters (ps_offload.trainer.offload.param_binding),
    so the losses fall and equal torch.optim.AdamW's in the same set-up, up to float
    reassociation (the offload run used to stay at its first loss while the daemons' versions
    advanced)."""
    steps = 12
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "tests.integration.hf_trainer_worker", "--daemons", daemon.address, "--out", str(tmp_path),
         "--steps", str(steps)],
        capture_output=True, text=True, timeout=540, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    runs = torch.load(tmp_path / "runs.pt")
    offloaded, reference = runs["offload"], runs["torch"]
    assert offloaded["version"] == steps and offloaded["global_step"] == steps
    losses = [entry["loss"] for entry in offloaded["history"]]
    expected = [entry["loss"] for entry in reference["history"]]
    assert len(losses) == len(expected) == steps
    assert losses[-1] < losses[0] - 0.5, losses  # it trains
    assert losses == pytest.approx(expected, rel=1e-4), (losses, expected)
    for name, value in reference["weights"].items():
        err = (offloaded["weights"][name] - value).norm() / value.norm()
        assert err <= 1e-5, (name, float(err))
