"""One trainer process for tests/integration/test_streaming_memory.py: builds a GPT of the
given depth, offloads it to one daemon (streamed with a window of two blocks, or whole with
--whole), trains two steps (the first of two micro-batches) and prints one JSON line with its
memory figures.

Peak RSS is read from /proc/self/status (VmHWM), not from getrusage's ru_maxrss: Linux keeps
ru_maxrss across execve, so a child of a large process (pytest with torch loaded) reports
at least its parent's peak, which would hide everything this process allocates below it.
VmHWM belongs to this process's own address space, created at exec; the worker resets it
(/proc/self/clear_refs) once its imports are done, so the imports' transient peak is not
counted either.

--trim-heap returns glibc's free pages to the kernel (malloc_trim) after each block's forward,
each parameter's gradient and each module's initialisation, so that RSS counts what the
trainer holds rather than what malloc keeps: without it, block-sized buffers freed between
small allocations that live on (activations saved for backward) stay resident, and RSS grows
by about half a block per block of depth although the live bytes do not. Only public hooks
are used (module forward hooks, post-accumulate-grad hooks, Streaming.init), registered after
the optimizer's own, so each trim runs after the optimizer's release.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch
from torch import nn

from ps_offload import trainer
from ps_offload.trainer.debug_models import GPTConfig, TinyGPT

WINDOW_BLOCKS = 2
MICRO_BATCHES = (2, 1)  # per step: the first step accumulates two backward passes
BATCH = 1


def gpt_config(depth: int) -> GPTConfig:
    """Blocks of 1.8M parameters (6.8 MiB in fp32), with a small vocabulary and context so
    that the embeddings and activations are small beside them."""
    return GPTConfig(vocab_size=64, block_size=16, n_layer=depth, n_head=6, n_embd=384)


def memory_kib(field: str) -> int:
    """A `Vm*` line of /proc/self/status, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status")


def reset_peak() -> None:
    """Sets VmHWM to the current RSS (proc(5), /proc/pid/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def install_trims(model: nn.Module, trim) -> None:
    """A trim after each block's forward (the optimizer released the block in its own hook,
    registered earlier) and after each parameter's gradient (the last one of a block releases
    it and its gradient buffer)."""
    for block in model.blocks:
        block.register_forward_hook(lambda _m, _a, _out: trim())
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: trim())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--daemon", required=True)
    p.add_argument("--depth", type=int, required=True)
    p.add_argument("--name", required=True, help="the model's name on the daemon")
    p.add_argument("--whole", action="store_true", help="no streaming: the whole model on the trainer")
    p.add_argument("--trim-heap", action="store_true", help="malloc_trim after each block (module docstring)")
    args = p.parse_args()
    torch.set_num_threads(1)
    malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim if args.trim_heap else None

    def trim() -> None:
        if malloc_trim is not None:
            malloc_trim(0)

    trim()
    reset_peak()
    baseline_bytes = memory_kib("VmRSS") * 1024  # torch, grpc and ps_offload imported; no model yet
    started = time.monotonic()

    config = gpt_config(args.depth)
    torch.manual_seed(0)
    stream = None
    if args.whole:
        model = TinyGPT(config)
    else:
        with torch.device("meta"):
            model = TinyGPT(config)
    block_bytes = parameter_bytes(model.blocks[0])
    model_bytes = parameter_bytes(model)
    resident_bytes = model_bytes - sum(parameter_bytes(b) for b in model.blocks)
    window_bytes = WINDOW_BLOCKS * block_bytes
    if not args.whole:

        def init(module: nn.Module) -> None:
            # As Streaming's default (each module's reset_parameters), then a trim: the
            # previous unit was pushed and released before this one was allocated.
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            trim()

        stream = trainer.Streaming(
            blocks=list(model.blocks), window_bytes=window_bytes, device="cpu", init=init if args.trim_heap else None
        )
    opt = trainer.offload(
        model, daemons=[args.daemon], optimizer=trainer.AdamW(lr=1e-3),
        config=trainer.OffloadConfig(model_name=args.name, shard_bytes=4 << 20), stream=stream,
    )  # fmt: skip
    if args.trim_heap:
        install_trims(model, trim)

    data = torch.Generator().manual_seed(1)
    losses = []
    with opt:
        for micro_batches in MICRO_BATCHES:
            for _ in range(micro_batches):
                idx = torch.randint(config.vocab_size, (BATCH, config.block_size), generator=data)
                _, loss = model(idx, idx)
                (loss / micro_batches).backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        peak_block_bytes = opt.stats["peak_block_bytes"] if stream is not None else None

    print(
        json.dumps(
            {
                "depth": args.depth,
                "whole": args.whole,
                "trim_heap": args.trim_heap,
                "baseline_bytes": baseline_bytes,
                "peak_bytes": memory_kib("VmHWM") * 1024,
                "block_bytes": block_bytes,
                "window_bytes": window_bytes,
                "resident_bytes": resident_bytes,
                "model_bytes": model_bytes,
                "peak_block_bytes": peak_block_bytes,
                "losses": losses,
                "seconds": time.monotonic() - started,
            }
        )
    )


if __name__ == "__main__":
    main()
