"""One rank of `torchrun --nproc-per-node 2` running examples/hf_trainer.py twice: the offload
optimizer on the daemons, then torch.optim.AdamW(fused=True) in process, on the same data
(tests/integration/test_hf_trainer.py compares them). Rank 0 saves both runs' logged losses
and final weights to --out."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch

from tests.helpers.site_first import site_packages_first

site_packages_first()  # before transformers looks for PyPI's `kernels`

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--daemons", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("hf_trainer_example", ROOT / "examples" / "hf_trainer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = Path(args.out)
    runs = {}
    for optimizer in ("offload", "torch"):
        runs[optimizer] = example.main([
            "--daemons", args.daemons, "--output-dir", str(out / optimizer), "--steps", str(args.steps),
            "--total-steps", str(args.steps), "--save-steps", "1000", "--logging-steps", "1",
            "--optimizer", optimizer, "--model-name", "hf-ddp",
        ])  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(runs, out / "runs.pt")


if __name__ == "__main__":
    main()
