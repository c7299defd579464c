"""One trainer of bench/zero_infinity.py in a process of its own, stepping on command:

    python -m bench.zero_infinity_worker {ours,deepspeed,compute,ours_unsynced} --spec JSON --reply-fd N

It builds its GPT (bench/zero_infinity.py's `RunSpec`: the same TinyGPT, initial values, batches,
AdamW and thread count on both sides), answers {"ready": ...} on the reply descriptor, then
reads commands on stdin, one per line, and answers each with one JSON line:

    steps K   K training steps, then what the step left in flight (ours: the resident
              parameters' pulls; DeepSpeed: its parameter swapper's writes) is waited for;
              answers {"seconds": the K steps' wall time, "losses": [...]}
    stats     {"peak_rss_bytes": this process's peak RSS (+ the daemon's, ours), ...}
    quit      exits

Replies go to their own descriptor because DeepSpeed prints to stdout (which, with stderr, goes
to the worker's log file). A failure answers {"error": ...} and exits 1.

`ours`: a ps-daemon with an NVMe tier (its RAM tier smaller than the state), and the model
built on the meta device, streamed a window of blocks at a time (trainer/stream/optimizer.py), each
block's gradient applied by the daemon as backward pushes it (Streaming(micro_batches=1)).
`deepspeed`: ZeRO stage 3 with offload_param and offload_optimizer on NVMe, the model built
inside `deepspeed.zero.Init`; see bench/zero_infinity.py for the configuration and the errors
met on the way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch
from torch import nn

from ps_offload.trainer.debug_models import GPTConfig, TinyGPT


def _reply(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def initial_value(name: str, module: nn.Module, shape: torch.Size, n_layer: int) -> torch.Tensor:
    """Parameter `name`'s initial value, as TinyGPT's own init draws it (N(0, 0.02) weights,
    the residual projections scaled by 1/sqrt(2 n_layer), zero biases, unit norms), from a
    generator seeded by the name, so both sides compute it one module at a time."""
    if isinstance(module, nn.LayerNorm):
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    std = 0.02 / (2 * n_layer) ** 0.5 if name.endswith("proj.weight") else 0.02
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std


def batch(spec: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s tokens and targets (random, the same on both sides)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(spec["gpt"]["vocab_size"], (spec["batch"], spec["gpt"]["block_size"] + 1),
                           generator=generator)  # fmt: skip
    return tokens[:, :-1], tokens[:, 1:]


def _no_decay(shape: torch.Size) -> bool:
    return len(shape) < 2  # biases and norms, as the other benchmarks


def _peak_rss(pid: int | str = "self") -> int:
    """The process's peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux keeps that across
    execve, so under `make bench` every worker reported its parent's peak (4.19 GB for ours and
    DeepSpeed alike, the bench runner's). bench.common.peak_rss does the same, but importing
    bench.common (gRPC, the daemon) into the DeepSpeed and compute workers would add to the
    peak RSS they report."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _du(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


PROFILE_AFTER = 2  # steps: bench/zero_infinity.py's warm-up (Size.warmup)


class Ours:
    """The streamed trainer on a local daemon with an NVMe tier."""

    fsync = True  # the daemon's store.fsync

    def __init__(self, spec: dict) -> None:
        from bench.common import BenchDaemon
        from ps_offload import trainer

        self.nvme_dir = spec["nvme_dir"]
        self.ram_bytes = spec["ours"]["ram_bytes"]
        config = []
        if not self.fsync:
            path = Path(self.nvme_dir).with_suffix(".toml")
            path.write_text("[store]\nfsync = false\n")
            config = ["--config", str(path)]
        self.daemon = BenchDaemon(
            "--nvme-dir", self.nvme_dir, "--ram-bytes", str(spec["ours"]["ram_bytes"]),
            "--shard-bytes", str(spec["ours"]["shard_bytes"]), *config,
        )  # fmt: skip
        gpt = GPTConfig(**spec["gpt"])
        with torch.device("meta"):
            model = TinyGPT(gpt)
        names = {id(p): n for n, p in model.named_parameters()}

        def init(module: nn.Module) -> None:
            with torch.no_grad():
                for p in module.parameters(recurse=False):
                    p.copy_(initial_value(names[id(p)], module, p.shape, gpt.n_layer))

        block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        adamw = spec["adamw"]
        self.opt = trainer.offload(
            model,
            daemons=[self.daemon.address],
            optimizer=trainer.AdamW(lr=adamw["lr"], betas=tuple(adamw["betas"]), eps=adamw["eps"],
                                    weight_decay=adamw["weight_decay"]),  # fmt: skip
            no_weight_decay=lambda name, p: _no_decay(p.shape),
            config=trainer.OffloadConfig(model_name="zero_infinity", shard_bytes=spec["ours"]["shard_bytes"]),
            stream=trainer.Streaming(
                blocks=list(model.blocks), window_bytes=spec["ours"]["window_blocks"] * block_bytes,
                micro_batches=1, init=init, device="cpu",
            ),
        )  # fmt: skip
        self.model = model

        self.phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}  # seconds, over the profiled steps
        self.steps = 0
        self.seen = 0
        self.daemon_at_start: dict | None = None
        self.waits_at_start: dict = {}

    def _waits(self) -> dict:
        """The trainer's waits so far: for pulls prefetch did not hide, and for pushes (the
        backward's window of pushes in flight, and step()'s wait for the last ones)."""
        return {k: self.opt.stats[k] for k in ("pull_wait_seconds", "push_wait_seconds")}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.seen += 1
        if self.seen <= PROFILE_AFTER:  # the warm-up: not profiled
            return self._step(x, y)
        if self.daemon_at_start is None:
            self.daemon_at_start = self._daemon_stats()
            self.waits_at_start = self._waits()
        return self._step(x, y, profile=True)

    def _step(self, x: torch.Tensor, y: torch.Tensor, profile: bool = False) -> float:
        started = time.perf_counter()
        _, loss = self.model(x, y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        done = time.perf_counter()
        if profile:
            self.phases["forward"] += forward - started
            self.phases["backward"] += backward - forward
            self.phases["step"] += done - backward
            self.steps += 1
        return loss.item()

    def settle(self) -> None:
        self.opt.synchronize()  # the resident parameters' pulls that step() started

    def _daemon_stats(self) -> dict:
        from ps_offload.admin import client

        s = client.stats(self.daemon.address, 10.0)
        names = ("nvme_bytes_read", "nvme_bytes_written", "nvme_read_seconds", "nvme_write_seconds",
                 "nvme_master_reads", "window_loads", "optimizer_seconds", "tier_misses", "nvme_commits",
                 "nvme_commit_groups", "nvme_flushes", "nvme_flush_seconds")  # fmt: skip
        ticks = Path(f"/proc/{self.daemon.process.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]
        cpu = {"cpu_seconds": sum(int(t) for t in ticks) / os.sysconf("SC_CLK_TCK")}  # user + system, all threads
        return {**{name: getattr(s, name) for name in names}, **cpu}

    def stats(self) -> dict:
        now, before = self._daemon_stats(), self.daemon_at_start or {}
        per_step = {k: round((v - before.get(k, 0)) / max(self.steps, 1), 3) for k, v in now.items()}
        return {
            "peak_rss_bytes": _peak_rss() + _peak_rss(self.daemon.process.pid),
            "trainer_peak_rss_bytes": _peak_rss(),
            "daemon_peak_rss_bytes": _peak_rss(self.daemon.process.pid),
            "nvme_bytes": _du(self.nvme_dir),
            "block_pulls": dict(self.opt.stats),
            "window": self._window(),
            # Where a step goes: the trainer's phases, and the daemon's work per step (its I/O
            # seconds are summed over its I/O threads).
            "phase_ms": {k: round(1000 * v / max(self.steps, 1), 1) for k, v in self.phases.items()},
            "freed_memory": "returned to the kernel" if self.opt.returns_freed else "kept in malloc's heap",
            "daemon_per_step": per_step,
            "waits_ms_per_step": {
                k.removesuffix("_seconds"): round(1000 * (v - self.waits_at_start.get(k, 0)) / max(self.steps, 1), 1)
                for k, v in self._waits().items()
            },
        }

    def _window(self) -> dict:
        """The daemon's residency window for this model (ps_offload.daemon.store.residency_window)
        and the bytes per parameter a step must move with it: AdamW's 12 read and 12 written
        for every parameter, and 4 more read (its forward's master) for those outside it."""
        from ps_offload.daemon.store.residency_window import plan_window
        from ps_offload.daemon.store.shard import arena_nbytes
        from ps_offload.optimizers import AdamW

        arenas = [arena_nbytes(s.numel, AdamW()) for s in self.opt.plan]
        plan = plan_window(self.ram_bytes, arenas, depth=2, models=1)
        outside = max(0.0, 1 - plan.window_bytes / sum(arenas))
        return {"shards": len(arenas), "window_bytes": plan.window_bytes, "window_shards": plan.shards,
                "bound_bytes_per_param": round(24 + 4 * outside, 2)}  # fmt: skip

    def close(self) -> None:
        self.opt.close()
        self.daemon.__exit__(None, None, None)


def deepspeed_config(spec: dict) -> dict:
    """ZeRO-Infinity as DeepSpeed documents it: stage 3, parameters and optimizer state on
    NVMe, async I/O; DeepSpeed's defaults for the buffers, except the reuse distance
    (bench/zero_infinity.py's docstring says why)."""
    adamw = spec["adamw"]
    nvme = {"device": "nvme", "nvme_path": spec["nvme_dir"]}
    return {
        "train_batch_size": spec["batch"],
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "optimizer": {"type": "AdamW", "params": {"lr": adamw["lr"], "betas": list(adamw["betas"]),
                                                  "eps": adamw["eps"], "weight_decay": adamw["weight_decay"]}},
        "zero_optimization": {
            "stage": 3,
            "stage3_max_reuse_distance": 0,
            "offload_param": dict(nvme, **spec["deepspeed"].get("offload_param", {})),
            "offload_optimizer": dict(nvme, **spec["deepspeed"].get("offload_optimizer", {})),
            **spec["deepspeed"].get("zero", {}),
        },
        "aio": spec["deepspeed"]["aio"],
    }  # fmt: skip


class DeepSpeed:
    """DeepSpeed ZeRO-Infinity, one CPU process, gloo."""

    def __init__(self, spec: dict) -> None:
        os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        self.nvme_dir = spec["nvme_dir"]
        config = deepspeed_config(spec)
        gpt = GPTConfig(**spec["gpt"])
        # No dtype argument: Init(dtype=torch.float32) gives bfloat16 on CPUs without fp16 (the
        # module docstring); with the config and no dtype, Init takes fp32 from it.
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = TinyGPT(gpt)
        # TinyGPT's own init ran on partitioned (empty) parameters: set each module's values
        # with the parameters gathered, as DeepSpeed's docs do for a model's init.
        names = {id(p): n for n, p in model.named_parameters()}
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            with deepspeed.zero.GatheredParameters(own, modifier_rank=0), torch.no_grad():
                for p in own:
                    p.copy_(initial_value(names[id(p)], module, p.shape, gpt.n_layer))
        params = list(model.parameters())
        groups = [
            {"params": [p for p in params if not _no_decay(p.ds_shape)]},
            {"params": [p for p in params if _no_decay(p.ds_shape)], "weight_decay": 0.0},
        ]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        self.swapper = getattr(params[0], "nvme_swapper", None)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def settle(self) -> None:
        if self.swapper is not None:
            self.swapper.synchronize_writes()  # parameter swap-outs still in flight

    def stats(self) -> dict:
        return {"peak_rss_bytes": _peak_rss(), "nvme_bytes": _du(self.nvme_dir)}

    def close(self) -> None:
        pass


class ComputeOnly:
    """Not a contender: the same model's forward and backward in RAM, no optimizer and no
    disk. No offload system's step is shorter here, so DeepSpeed's step over this one is the
    most any of them could gain on it on this machine (the figure's physical bound)."""

    def __init__(self, spec: dict) -> None:
        gpt = GPTConfig(**spec["gpt"])
        self.model = TinyGPT(gpt)
        modules = {n: m for n, m in self.model.named_modules()}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                owner = modules[name.rpartition(".")[0]]
                p.copy_(initial_value(name, owner, p.shape, gpt.n_layer))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        _, loss = self.model(x, y)
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return loss.item()

    def settle(self) -> None:
        pass

    def stats(self) -> dict:
        return {"peak_rss_bytes": _peak_rss(), "nvme_bytes": 0}

    def close(self) -> None:
        pass


class OursUnsynced(Ours):
    """Not a contender: ours with the daemon's store.fsync = false, durable across its own
    crash but not a power cut, as DeepSpeed's swapped state is not (it never syncs): what
    durability at every acknowledgement costs ours here."""

    fsync = False


SYSTEMS = {"ours": Ours, "deepspeed": DeepSpeed, "compute": ComputeOnly, "ours_unsynced": OursUnsynced}


def _usage_since(before) -> dict:
    """This process's CPU seconds (all its threads) and page faults since `before`."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": now.ru_utime - before.ru_utime, "system_s": now.ru_stime - before.ru_stime,
            "minor_faults": now.ru_minflt - before.ru_minflt}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=tuple(SYSTEMS))
    parser.add_argument("--spec", required=True, help="RunSpec as JSON")
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    fd = args.reply_fd
    torch.set_num_threads(spec["threads"])
    try:
        started = time.perf_counter()
        torch.manual_seed(0)
        system = SYSTEMS[args.system](spec)
        _reply(fd, {"ready": True, "init_seconds": round(time.perf_counter() - started, 2)})
        step = 0
        for line in sys.stdin:
            command = line.split()
            if not command:
                continue
            if command[0] == "steps":
                losses = []
                usage = resource.getrusage(resource.RUSAGE_SELF)
                started = time.perf_counter()
                for _ in range(int(command[1])):
                    losses.append(system.step(*batch(spec, step)))
                    step += 1
                system.settle()
                seconds = time.perf_counter() - started
                _reply(fd, {"seconds": seconds, "losses": losses, "usage": _usage_since(usage)})
            elif command[0] == "stats":
                _reply(fd, system.stats())
            elif command[0] == "quit":
                system.close()
                _reply(fd, {"bye": True})
                return
            else:
                raise ValueError(f"unknown command {line!r}")
    except BaseException as exc:
        traceback.print_exc()
        sys.stderr.flush()
        _reply(fd, {"error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)


if __name__ == "__main__":
    main()
