"""train_step_overhead_bf16: the demo model in bf16 through a local daemon (bf16 gradients
pushed, bf16 values pulled, fp32 master and AdamW on the daemon) against the in-process
mixed-precision spelling with fp32 masters and torch.optim.AdamW(fused=True); the method is
bench/train_step_overhead.py's. Target <= 1.10.

    python -m bench.train_step_overhead_bf16
"""

from __future__ import annotations

import torch

from bench.train_step_overhead import run


def main() -> dict:
    return run(torch.bfloat16)


if __name__ == "__main__":
    main()
