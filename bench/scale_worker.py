"""The trainer of `make bench-scale` (bench/scale.py), in a process of its own so that its
peak RSS is its own: a GPT built on the meta device, streamed block by block through one
daemon (trainer/stream/optimizer.py), driven one step at a time over stdin and stdout.

    python -m bench.scale_worker --daemon ADDR --n-layer L --n-embd E --shard-bytes B
    stdin:  "step" (one forward, backward and optimizer step), "close"
    stdout: one JSON line per event: "ready" once the model is created and pushed, "step"
            after each step, "closed" at the end

The driver runs fio between steps, so the worker waits for its next "step" line doing
nothing. Peak RSS is this process's VmHWM (/proc/self/status): its whole life, the import
of torch included. Anything else this process prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import ps_offload
from bench.common import REPO, peak_rss
from ps_offload.trainer.debug_models import GPTConfig, TinyGPT

BATCH = 1
WINDOW_BLOCKS = 2  # the running block and the one prefetched
LR = 3e-5  # no warm-up: at n_embd 2560, 3e-4 makes the loss of the same batch rise after one step
HEAD_DIM = 128


def gpt_config(*, n_layer: int, n_embd: int, block_size: int) -> GPTConfig:
    """A byte-level GPT (vocabulary 256): its blocks are nearly all of its parameters."""
    return GPTConfig(
        vocab_size=256, block_size=block_size, n_layer=n_layer, n_head=max(1, n_embd // HEAD_DIM), n_embd=n_embd
    )


class _Fp32MathLinearFn(torch.autograd.Function):
    """y = x W^T + b with bf16 inputs and output, the products taken in fp32. It saves the bf16
    weight itself (the streamed parameter, whose memory the trainer frees and pulls again before
    backward), never a widened copy, which would hold an fp32 model's worth of anonymous memory
    until backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.float().reshape(-1, grad.shape[-1])
        grad_x = (grad @ weight.float()).to(x.dtype).reshape(x.shape)
        grad_weight = (grad.T @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        grad_bias = grad.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias


class Fp32MathLinear(nn.Linear):
    """A bf16 Linear that multiplies in fp32 on the CPU: torch 2.13's CPU bf16 GEMM, on a CPU
    without bf16 instructions (this AVX2 machine), takes 9.6 s for the backward's `grad @ weight`
    of one 64 x 10240 by 10240 x 2560 product against 0.08 s through fp32, so without it the
    scale run would time that kernel rather than the daemon or the disk. Parameters, gradients,
    pulls and pushes stay bf16; only each product's inputs are widened, for the call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp32MathLinearFn.apply(x, self.weight, self.bias)


def multiply_in_fp32(model: nn.Module) -> None:
    """Makes every nn.Linear of `model` an Fp32MathLinear (same parameters, hooks and names)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Fp32MathLinear


def gpt_init(model: TinyGPT):
    """Streaming.init for a meta TinyGPT: TinyGPT's own initialisation (nanoGPT's: normal
    0.02 for linear and embedding weights, zero biases, the residual projections scaled by
    1/sqrt(2 n_layer)), module by module; LayerNorms their reset_parameters()."""
    names = {id(m): n for n, m in model.named_modules()}
    proj_std = 0.02 / math.sqrt(2 * model.config.n_layer)

    def init(module: nn.Module) -> None:
        with torch.no_grad():
            TinyGPT._init(module)
            if isinstance(module, nn.Linear) and names[id(module)].endswith("proj"):
                nn.init.normal_(module.weight, std=proj_std)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    return init


def batch(block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch every step (the bytes of this repository's README), so a falling loss
    shows the updates landing."""
    data = torch.frombuffer(bytearray((REPO / "README.md").read_bytes()[: BATCH * (block_size + 1)]), dtype=torch.uint8)
    tokens = data.long().view(BATCH, block_size + 1)
    return tokens[:, :-1], tokens[:, 1:]


class Events:
    """The JSON lines to the driver, on what was stdout; file descriptor 1 then points at
    stderr, so nothing else (a warning, a library's print) can land among them."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def emit(self, event: str, **fields) -> None:
        self._out.write(json.dumps({"event": event, **fields}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--daemon", required=True)
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--n-embd", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--shard-bytes", type=int, required=True)
    p.add_argument("--streams", type=int, default=2, help="concurrent pushes and pulls (ClientConfig)")
    p.add_argument("--model-name", default="scale")
    args = p.parse_args()
    events = Events()

    torch.manual_seed(0)  # the initial values (set one block at a time, in order)
    config = gpt_config(n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block_size)
    with torch.device("meta"):
        model = TinyGPT(config).to(torch.bfloat16)
    multiply_in_fp32(model)  # the trainer runs on the CPU here (Fp32MathLinear says why)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    started = time.perf_counter()
    opt = ps_offload.offload(
        model, daemons=[args.daemon], optimizer=ps_offload.AdamW(lr=LR), no_weight_decay=lambda _, p: p.dim() < 2,
        config=ps_offload.OffloadConfig(model_name=args.model_name, shard_bytes=args.shard_bytes),
        client=ps_offload.ClientConfig(rpc_timeout_seconds=600, streams_per_daemon=args.streams),
        stream=ps_offload.Streaming(
            blocks=list(model.blocks), window_bytes=WINDOW_BLOCKS * block_bytes, micro_batches=1, device="cpu",
            init=gpt_init(model),
        ),
    )  # fmt: skip
    events.emit(
        "ready", create_seconds=time.perf_counter() - started, params=sum(p.numel() for p in model.parameters()),
        shards=len(opt.plan), peak_rss_bytes=peak_rss(),
    )  # fmt: skip
    x, y = batch(config.block_size)
    with opt:
        for line in sys.stdin:
            command = line.strip()
            if command == "close":
                break
            if command != "step":
                raise SystemExit(f"scale_worker: unknown command {command!r}")
            started = time.perf_counter()
            _, loss = model(x, y)
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            opt.step()
            opt.zero_grad()
            done = time.perf_counter()
            events.emit(
                "step", loss=loss.item(), seconds=done - started, forward_seconds=forward - started,
                backward_seconds=backward - forward, step_seconds=done - backward, peak_rss_bytes=peak_rss(),
            )  # fmt: skip
    events.emit("closed", peak_rss_bytes=peak_rss(), block_pulls=opt.stats)


if __name__ == "__main__":
    main()
