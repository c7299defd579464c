"""Train the character GPT with its optimizer on ps-daemons.

    python examples/train_gpt.py --daemons 127.0.0.1:50051 --steps 300

The whole integration is two lines: `trainer.offload(...)` instead of building a
torch.optim optimizer, and `opt.step()` as usual. `--local` trains the same model with
torch.optim.AdamW(fused=True) in-process instead, for comparison.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

import trainer
from trainer.debug_models import CharDataset, GPTConfig, TinyGPT

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--daemons",
        default=os.environ.get("PS_DAEMONS", "127.0.0.1:50051"),
        help="comma-separated daemon addresses, in plan order (env PS_DAEMONS)",
    )
    p.add_argument("--local", action="store_true", help="in-process torch AdamW instead of the daemons")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine decay")
    p.add_argument("--shard-bytes", type=int, default=1 << 20)
    p.add_argument("--model-name", default="char-gpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=200, help="characters to generate at the end (0: none)")
    return p.parse_args(argv)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def build(args: argparse.Namespace) -> tuple[TinyGPT, CharDataset]:
    torch.manual_seed(args.seed)
    data = CharDataset(CORPUS.read_text(), args.block_size, seed=args.seed)
    config = GPTConfig(data.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
    return TinyGPT(config), data


def no_weight_decay(name: str, p: torch.nn.Parameter) -> bool:
    return p.dim() < 2  # biases and norms, as nanoGPT does


def train(args: argparse.Namespace) -> list[float]:
    model, data = build(args)
    if args.local:
        decay = [p for n, p in model.named_parameters() if not no_weight_decay(n, p)]
        other = [p for n, p in model.named_parameters() if no_weight_decay(n, p)]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=args.lr, fused=True
        )
    else:
        opt = trainer.offload(
            model,
            daemons=args.daemons.split(","),
            optimizer=trainer.AdamW(lr=args.lr, weight_decay=0.1),
            model_name=args.model_name,
            shard_bytes=args.shard_bytes,
            no_weight_decay=no_weight_decay,
        )
    n_params = sum(p.numel() for p in model.parameters())
    where = "in-process AdamW" if args.local else f"AdamW on {args.daemons}"
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {data.vocab_size}; optimizer: {where}")
    losses: list[float] = []
    started = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True)
    for step in bar:
        lr = lr_at(step, args)
        if args.local:
            for group in opt.param_groups:
                group["lr"] = lr
        else:
            opt.lr = lr
        x, y = data.batch(args.batch_size)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}", lr=f"{lr:.1e}")
    elapsed = time.perf_counter() - started
    if not args.local:
        opt.synchronize()
    print(
        f"loss {losses[0]:.3f} -> {sum(losses[-20:]) / len(losses[-20:]):.3f} "
        f"in {args.steps} steps, {1000 * elapsed / args.steps:.1f} ms/step"
    )
    if args.sample:
        print("sample:", repr(sample(model, data, args.sample)))
    if not args.local:
        opt.close()
    return losses


@torch.no_grad()
def sample(model: TinyGPT, data: CharDataset, n: int) -> str:
    model.eval()
    generator = torch.Generator().manual_seed(0)
    idx = torch.tensor([[data.stoi["T"]]])
    for _ in range(n):
        logits = model(idx[:, -model.config.block_size :])[:, -1, :]
        nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    model.train()
    return data.decode(idx[0].tolist())


if __name__ == "__main__":
    train(parse_args())
