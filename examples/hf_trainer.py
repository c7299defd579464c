"""Fine-tune a Hugging Face model with the Hugging Face Trainer, its optimizer on ps-daemons.

    ps-daemon serve --listen 127.0.0.1:50051 &
    python examples/hf_trainer.py --daemons 127.0.0.1:50051 --output-dir /tmp/hf-run --steps 40
    python examples/hf_trainer.py --daemons 127.0.0.1:50051 --output-dir /tmp/hf-run --steps 80 --resume
    torchrun --nproc-per-node 2 examples/hf_trainer.py --daemons 127.0.0.1:50051 --output-dir /tmp/hf-ddp

The model is a small GPT-2 built from its config (nothing is downloaded), with its input and
output embeddings tied, trained on the characters of examples/data/corpus.txt. The offload
optimizer and a transformers scheduler go to the Trainer through `optimizers=(opt, sched)`;
the Trainer clips, steps, schedules and checkpoints as it does for torch.optim.AdamW.

Resuming: the daemons still hold the model (registering the same name and spec resumes from
their state), and the Trainer loads the checkpoint it saved last: the model weights, the
optimizer's state dict (which names the daemons' version, and is refused if they hold
another), the scheduler and the data position.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_cosine_schedule_with_warmup
from transformers.trainer_utils import get_last_checkpoint

import ps_offload

CORPUS = Path(__file__).with_name("data") / "corpus.txt"


class CharWindows(torch.utils.data.Dataset):
    """Fixed windows of a text's bytes (a 128-symbol vocabulary): input_ids and labels."""

    def __init__(self, text: str, block_size: int, count: int, seed: int = 0) -> None:
        data = torch.tensor(list(text.encode("ascii", "replace")), dtype=torch.long) % 128
        starts = torch.randint(len(data) - block_size, (count,), generator=torch.Generator().manual_seed(seed))
        self.windows = [data[s : s + block_size] for s in starts.tolist()]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict:
        window = self.windows[index]
        return {"input_ids": window, "labels": window}


def build_model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.dim() < 2  # biases and layer norms, as Hugging Face's own AdamW set-up


def main(argv: list[str] | None = None) -> dict:
    """Trains; returns the logged losses, the Trainer's global step and the daemons' version."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--daemons", default=os.environ.get("PS_DAEMONS", "127.0.0.1:50051"))
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=40, help="train up to this global step")
    parser.add_argument("--total-steps", type=int, default=80, help="the schedule's length")
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model-name", default="hf-gpt2")
    parser.add_argument("--resume", action="store_true", help="go on from the last checkpoint in --output-dir")
    parser.add_argument(
        "--optimizer", choices=["offload", "torch"], default="offload",
        help="offload: AdamW on the daemons; torch: torch.optim.AdamW(fused=True) in process, the same groups",
    )  # fmt: skip
    ps_offload.ClientSecurity.add_arguments(parser)  # --ca-file, --token-file, ...: else $PS_TLS_CA_FILE, ...
    args = parser.parse_args(argv)

    model = build_model()
    if args.optimizer == "offload":
        opt = ps_offload.offload(
            model,
            daemons=args.daemons.split(","),
            optimizer=ps_offload.AdamW(lr=args.lr, weight_decay=0.01),
            no_weight_decay=no_weight_decay,
            config=ps_offload.OffloadConfig(model_name=args.model_name, shard_bytes=64 << 10),
            client=ps_offload.ClientConfig(security=ps_offload.ClientSecurity.from_arguments(args)),
        )
    else:
        named = list(model.named_parameters())
        opt = torch.optim.AdamW(
            [{"params": [p for n, p in named if not no_weight_decay(n, p)], "weight_decay": 0.01},
             {"params": [p for n, p in named if no_weight_decay(n, p)], "weight_decay": 0.0}],
            lr=args.lr, fused=True,
        )  # fmt: skip
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=5, num_training_steps=args.total_steps)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        save_steps=args.save_steps,
        logging_steps=args.logging_steps,
        per_device_train_batch_size=args.batch_size,
        max_grad_norm=1.0,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    dataset = CharWindows(CORPUS.read_text(), block_size=64, count=args.total_steps * args.batch_size)
    trainer = Trainer(model=model, args=training, train_dataset=dataset, optimizers=(opt, sched))
    checkpoint = get_last_checkpoint(args.output_dir) if args.resume else None
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        if args.optimizer == "offload":
            opt.close()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in history:
        print(f"step {entry['step']}: loss {entry['loss']:.4f}, lr {entry['learning_rate']:.2e}")
    version = getattr(opt, "step_count", None)
    print(f"global step {trainer.state.global_step}; daemons at version {version}")
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"history": history, "global_step": trainer.state.global_step, "version": version, "weights": weights}


if __name__ == "__main__":
    main()
