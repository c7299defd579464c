"""Train the character GPT with its optimizer on ps-daemons.

    python examples/train_gpt.py --daemons 127.0.0.1:50051 --steps 300
    torchrun --nproc-per-node 4 examples/train_gpt.py --pp 2 --dp 2 --daemons a:50051,b:50051

One process: the whole integration is two lines, `trainer.offload(...)` instead of building
a torch.optim optimizer, and `opt.step()` as usual. Under torchrun with --pp/--dp: the GPT as
a list of layers, split into pp pipeline stages with dp data-parallel replicas each
(trainer.PipelineTrainer). `--local` trains the same model with torch.optim.AdamW(fused=True)
in-process instead (trainer.LocalOptimizer), for comparison; `--staleness 1` uses the
delayed parameter update (the daemons apply step t while step t+1 computes);
`--compression onebit` (or bf16, fp16, topk) compresses the pushes after
`--compression-warmup-steps` plain steps (onebit under AdamW is 1-bit Adam).

Daemons: --daemons, else $PS_DAEMONS, else the TOML file $PS_CLUSTER_FILE (or --cluster-file)
with `daemons = ["host:port", ...]`; the same ordered list on every node.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from ps_offload import trainer
from ps_offload.trainer.debug_models import CharDataset, GPTConfig, TinyGPT, gpt_layers, gpt_loss

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--daemons", help="comma-separated daemon addresses, in plan order (else $PS_DAEMONS)")
    p.add_argument("--cluster-file", help="TOML file with daemons = [...] (else $PS_CLUSTER_FILE)")
    p.add_argument("--local", action="store_true", help="in-process torch AdamW instead of the daemons")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="global batch, over all replicas")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine decay")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--staleness", type=int, choices=(0, 1), default=0, help="1: delayed parameter update")
    p.add_argument(
        "--compression",
        choices=("none", "bf16", "fp16", "onebit", "topk"),
        default="none",
        help="how pushes travel (one process): onebit is 1-bit Adam under AdamW",
    )
    p.add_argument(
        "--compression-warmup-steps",
        type=int,
        default=None,
        help="uncompressed steps first (default: a fifth of --steps when compressing)",
    )
    p.add_argument("--shard-bytes", type=int, default=1 << 20)
    p.add_argument("--model-name", default="char-gpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=200, help="characters to generate at the end (0: none)")
    trainer.ClientSecurity.add_arguments(p)  # --ca-file, --token-file, ...: as ps-admin's, else $PS_TLS_CA_FILE, ...
    g = p.add_argument_group("pipeline x data parallel (under torchrun)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--dp", type=int, default=1, help="data-parallel replicas of each stage")
    g.add_argument("--microbatches", type=int, default=4, help="micro-batches per replica and step")
    g.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    return p.parse_args(argv)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def compression_warmup_steps(args: argparse.Namespace) -> int:
    if args.compression_warmup_steps is not None:
        return args.compression_warmup_steps
    return max(1, args.steps // 5) if args.compression != "none" else 0


def build(args: argparse.Namespace) -> tuple[TinyGPT, CharDataset]:
    torch.manual_seed(args.seed)
    data = CharDataset(CORPUS.read_text(), args.block_size, seed=args.seed)
    return TinyGPT(gpt_config(args, data)), data


def gpt_config(args: argparse.Namespace, data: CharDataset) -> GPTConfig:
    return GPTConfig(data.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)


def no_weight_decay(name: str, p: torch.nn.Parameter) -> bool:
    return p.dim() < 2  # biases and norms, as nanoGPT does


def train(args: argparse.Namespace, on_step: Callable[[object], None] | None = None) -> list[float]:
    """Trains in this process; returns the losses. `on_step(opt)` runs after every step."""
    model, data = build(args)
    optimizer = trainer.AdamW(lr=args.lr, weight_decay=0.1)
    if args.local:
        opt = trainer.LocalOptimizer(model, optimizer=optimizer, no_weight_decay=no_weight_decay)
    else:
        daemons = trainer.daemon_addresses(args.daemons, cluster_file=args.cluster_file)
        opt = trainer.offload(
            model,
            daemons=daemons,
            optimizer=optimizer,
            no_weight_decay=no_weight_decay,
            config=trainer.OffloadConfig(
                model_name=args.model_name, shard_bytes=args.shard_bytes, staleness=args.staleness
            ),
            compression=trainer.CompressionConfig(method=args.compression, warmup_steps=compression_warmup_steps(args)),
            client=trainer.ClientConfig(security=trainer.ClientSecurity.from_arguments(args)),
        )
    n_params = sum(p.numel() for p in model.parameters())
    where = "in-process AdamW" if args.local else f"AdamW on {','.join(daemons)}"
    if args.compression != "none" and not args.local:
        where += f", {args.compression} pushes after {compression_warmup_steps(args)} plain steps"
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {data.vocab_size}; optimizer: {where}")
    losses: list[float] = []
    started = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True)
    for step in bar:
        lr = lr_at(step, args)
        opt.lr = lr
        x, y = data.batch(args.batch_size)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(opt)
        if step % 10 == 0 or step == args.steps - 1:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}", lr=f"{lr:.1e}")
    elapsed = time.perf_counter() - started
    opt.synchronize()
    print(
        f"loss {losses[0]:.3f} -> {sum(losses[-20:]) / len(losses[-20:]):.3f} "
        f"in {args.steps} steps, {1000 * elapsed / args.steps:.1f} ms/step"
    )
    if not args.local:
        print(
            f"pushed {opt.bytes_pushed / 1e6:.1f} MB to the daemons ({opt.bytes_pushed / args.steps / 1e3:.1f} kB/step)"
        )
    if args.sample:
        print("sample:", repr(sample(model, data, args.sample)))
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


def train_pipeline(args: argparse.Namespace) -> list[float]:
    """One rank of a pp x dp run under torchrun. Every rank draws the same global batches
    (same seed) and takes its replica's slice; the first stage feeds the tokens, the last
    the targets. Losses are the last stage's first replica's, printed by that rank."""
    ctx = trainer.init_distributed(args.pp, args.dp)
    grid = ctx.grid
    if args.batch_size % (args.dp * args.microbatches):
        raise SystemExit(f"--batch-size {args.batch_size} must divide into dp x micro-batches = "
                         f"{args.dp} x {args.microbatches}")  # fmt: skip
    data = CharDataset(CORPUS.read_text(), args.block_size, seed=args.seed)
    torch.manual_seed(args.seed)
    # Every rank builds the whole (small) model and keeps its stage; a model too big for one
    # host would build its stage's layers only.
    layers = gpt_layers(gpt_config(args, data))
    daemons = None if args.local else trainer.daemon_addresses(args.daemons, cluster_file=args.cluster_file)
    model = trainer.PipelineTrainer(
        layers,
        gpt_loss,
        ctx=ctx,
        optimizer=trainer.AdamW(lr=args.lr, weight_decay=0.1),
        no_weight_decay=no_weight_decay,
        config=trainer.ParallelConfig(
            microbatches=args.microbatches, schedule=args.schedule, max_grad_norm=args.max_grad_norm
        ),
        daemons=daemons,
        offload=trainer.OffloadConfig(
            model_name=args.model_name, shard_bytes=args.shard_bytes, staleness=args.staleness
        ),
        client=None if args.local else trainer.ClientConfig(security=trainer.ClientSecurity.from_arguments(args)),
    )
    reporter = grid.last_stage and grid.replica == 0
    if reporter:
        n_params = sum(p.numel() for layer in layers for p in layer.parameters())
        where = "in-process AdamW" if args.local else f"AdamW on {','.join(daemons)}"
        print(f"model: {n_params / 1e6:.2f}M parameters in {args.pp} stages x {args.dp} replicas "
              f"({args.schedule}, {args.microbatches} micro-batches); optimizer: {where}")  # fmt: skip
    per_replica = args.batch_size // args.dp
    mine = slice(grid.replica * per_replica, (grid.replica + 1) * per_replica)
    losses: list[float] = []
    started = time.perf_counter()
    steps = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True, disable=not reporter)
    for step in steps:
        model.lr = lr_at(step, args)
        x, y = data.batch(args.batch_size)
        loss = model.step(x[mine] if grid.first_stage else None, y[mine] if grid.last_stage else None)
        if loss is not None:
            losses.append(loss)
            if step % 10 == 0 or step == args.steps - 1:
                steps.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    model.synchronize()
    elapsed = time.perf_counter() - started
    if reporter:
        print(
            f"loss {losses[0]:.3f} -> {sum(losses[-20:]) / len(losses[-20:]):.3f} "
            f"in {args.steps} steps, {1000 * elapsed / args.steps:.1f} ms/step"
        )
    model.close()
    torch.distributed.destroy_process_group()
    return losses if reporter else []


def main() -> None:
    args = parse_args()
    if not args.local:
        try:  # resolved once, so a bad list or file is one message, not a traceback per rank
            args.daemons = ",".join(trainer.daemon_addresses(args.daemons, cluster_file=args.cluster_file))
        except ValueError as exc:
            raise SystemExit(f"train_gpt.py: {exc}") from None
        args.cluster_file = None
    if args.pp * args.dp > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if args.compression != "none":
            raise SystemExit(
                "train_gpt.py: --compression compresses one process's pushes; under torchrun the pipeline "
                "trainer compresses its data-parallel all-reduce instead (ParallelConfig(dp_compression=...))"
            )
        train_pipeline(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
