"""stream_overhead: a GPT that fits, trained streamed (a window of blocks on the trainer,
trainer/stream/optimizer.py) vs unstreamed (the whole model on the trainer, offload()), through the
same daemon, interleaved in one run.

A step = forward, backward, optimizer step, for one micro-batch. Ratio = the streamed step
time (prefetch on, a window of 2 blocks, the default micro_batches=0: parts applied at step())
over the unstreamed one; target <= 1.15 (issue 25). Also reported, each against the same unstreamed
rounds: no prefetch (each block pulled when its hook needs it), and micro_batches=1 (each
block applied by the daemon as it is pushed, during backward). And two more pairs, interleaved in
the same rounds: both trainers with shards of BLOCK_SHARD_BYTES, so that each block is one shard
(a third of the streamed step's requests): what fewer, larger requests would buy; and both
trainers on a second daemon whose threads yield the cores (server.scheduling = "idle").

What streaming adds per step: every block pulled twice (forward and backward; the unstreamed
trainer pulls once) and its gradient copied out of `.grad` into a flat buffer; what prefetch
hides is the pulls' latency behind the previous block's compute. The result file splits the
added time (`overhead_split_ms`): wall, CPU of both processes, and the training thread's
waits on the wire (the streamed optimizer's `stats`), so a miss says whether it is latency
left unhidden or CPU work on the shared cores.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.common import BenchDaemon, CoreTimes, ProcessCpu, daemon_stats, median, quick, record, spread
from ps_offload import trainer
from ps_offload.proto import ps_pb2
from ps_offload.trainer.debug_models import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=quick(8, 2), n_head=4, n_embd=quick(256, 64))
BATCH = 8
STEPS_PER_ROUND = quick(5, 2)
ROUNDS = quick(8, 2)
SHARD_BYTES = 1 << 20
BLOCK_SHARD_BYTES = 4 << 20  # at least a block's bytes (3.2 MB): one shard a block
LR = 1e-3


def _no_decay(name, p):
    return p.dim() < 2


def streamed_model(initial: dict, stream_kwargs: dict):
    """CONFIG's GPT on the meta device, streamed a window of two blocks at a time, each module
    initialised from `initial` (a state_dict); returns (model, Streaming)."""
    with torch.device("meta"):
        model = TinyGPT(CONFIG)
    names = {id(m): n for n, m in model.named_modules()}

    def init(module):
        prefix = names[id(module)]
        with torch.no_grad():
            for name, t in module.named_parameters(recurse=False):
                t.copy_(initial[f"{prefix}.{name}" if prefix else name])

    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    stream = trainer.Streaming(blocks=list(model.blocks), init=init, device="cpu", window_bytes=2 * block_bytes,
                               **stream_kwargs)  # fmt: skip
    return model, stream


def reference_and_batches(steps: int) -> tuple[TinyGPT, dict, list]:
    """CONFIG's GPT as seeded, its initial state_dict, and `steps` batches of (tokens, targets)."""
    torch.manual_seed(0)
    reference = TinyGPT(CONFIG)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(CONFIG.vocab_size, (BATCH, CONFIG.block_size), generator=g),) * 2 for _ in range(steps)]
    return reference, initial, batches


def main() -> dict:
    reference, initial, batches = reference_and_batches(STEPS_PER_ROUND)
    contenders = {
        "streamed": {"prefetch": True},
        "streamed_no_prefetch": {"prefetch": False},
        "streamed_apply_on_push": {"prefetch": True, "micro_batches": 1},
        "streamed_block_shards": {"prefetch": True},
        "streamed_idle_daemon": {"prefetch": True},
    }
    peer_of = {name: "unstreamed" for name in contenders} | {
        "streamed_block_shards": "unstreamed_block_shards",
        "streamed_idle_daemon": "unstreamed_idle_daemon",
    }

    def shard_bytes(name: str) -> int:
        return BLOCK_SHARD_BYTES if name.endswith("_block_shards") else SHARD_BYTES

    with contextlib.ExitStack() as stack:
        idle_config = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ps-bench-"))) / "idle.toml"
        idle_config.write_text('[server]\nscheduling = "idle"\n')
        default_daemon = stack.enter_context(BenchDaemon())
        idle_daemon = stack.enter_context(BenchDaemon("--config", str(idle_config)))
        runs = {}
        daemon_of = {}  # contender -> the daemon it trains through

        def common(name: str) -> dict:
            daemon = daemon_of[name] = idle_daemon if name.endswith("_idle_daemon") else default_daemon
            return {"daemons": [daemon.address], "optimizer": trainer.AdamW(lr=LR), "no_weight_decay": _no_decay}

        for name in sorted(set(peer_of.values())):
            whole = TinyGPT(CONFIG)
            whole.load_state_dict(initial)
            config = trainer.OffloadConfig(model_name=name, shard_bytes=shard_bytes(name))
            runs[name] = (whole, trainer.offload(whole, config=config, **common(name)))
        for name, kwargs in contenders.items():
            model, stream = streamed_model(initial, kwargs)
            config = trainer.OffloadConfig(model_name=name, shard_bytes=shard_bytes(name))
            runs[name] = (model, trainer.offload(model, config=config, stream=stream, **common(name)))

        phases: dict[str, dict[str, list[float]]] = {}  # contender -> phase -> seconds per step
        # contender -> (trainer, daemon) CPU over its timed steps: where a miss's time goes
        cpu: dict[str, tuple[ProcessCpu, ProcessCpu]] = {}
        cpu_steps: dict[str, int] = {}
        requests: dict[str, int] = {}  # contender -> the daemon's pulls and pushes over its timed steps
        # contender -> phase -> the machine's core time over its timed steps: how busy the cores were
        cores: dict[str, dict[str, CoreTimes]] = {}
        # streamed contender -> the seconds its training thread waited on the wire over its timed
        # steps (StreamedOptimizer.stats): for pulls, for pushes, for step()'s APPLY round
        waited: dict[str, dict[str, float]] = {}

        trips: dict[str, int] = {}  # contender -> the round trips its local transport made over its timed steps

        def round_trips(opt) -> int:  # a batch of a block's shards is one (LocalClient.round_trips)
            return sum(getattr(t, "round_trips", 0) for t in opt.client.transports)

        def served(stats: ps_pb2.StatsResponse) -> int:
            return stats.pulls + stats.pushes_applied - stats.pulls_carried  # a carried pull rides on its push

        def steps(model, opt, name: str = "") -> float:
            daemon = daemon_of[name] if name else default_daemon
            served_before = served(daemon_stats(daemon.address)) if name else 0  # (before the CPU count)
            trips_before = round_trips(opt)
            waits_before = dict(opt.stats) if name in contenders else {}
            before = ProcessCpu.of(), ProcessCpu.of(daemon.process.pid)
            started = time.perf_counter()
            split = {"forward": 0.0, "backward": 0.0, "step": 0.0}
            busy = cores.setdefault(name, {phase: CoreTimes(0, 0) for phase in split})
            for x, y in batches:
                c0, t0 = CoreTimes.now(), time.perf_counter()
                _, loss = model(x, y)
                c1, t1 = CoreTimes.now(), time.perf_counter()
                loss.backward()
                c2, t2 = CoreTimes.now(), time.perf_counter()
                opt.step()
                opt.zero_grad()
                c3, t3 = CoreTimes.now(), time.perf_counter()
                split["forward"] += t1 - t0
                split["backward"] += t2 - t1
                split["step"] += t3 - t2
                for phase, (a, b) in zip(split, ((c0, c1), (c1, c2), (c2, c3)), strict=True):
                    busy[phase] += b - a
            elapsed = (time.perf_counter() - started) / len(batches)
            if name:
                trainer_cpu = ProcessCpu.of() - before[0]
                daemon_cpu = ProcessCpu.of(daemon.process.pid) - before[1]
                trainer_total, daemon_total = cpu.get(name, (ProcessCpu(0.0, 0.0, 0),) * 2)
                cpu[name] = (trainer_total + trainer_cpu, daemon_total + daemon_cpu)
                cpu_steps[name] = cpu_steps.get(name, 0) + len(batches)
                requests[name] = requests.get(name, 0) + served(daemon_stats(daemon.address)) - served_before
                trips[name] = trips.get(name, 0) + round_trips(opt) - trips_before
                if waits_before:
                    waits_after, total = opt.stats, waited.setdefault(name, {})
                    for key, value in waits_before.items():
                        if key.endswith("_seconds"):
                            total[key] = total.get(key, 0.0) + waits_after[key] - value
            for phase, seconds in split.items():
                phases.setdefault(name, {}).setdefault(phase, []).append(seconds / len(batches))
            return elapsed

        names = list(runs)
        for name in names:  # warm-up (and the first forward's prefetch order)
            steps(*runs[name])
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(ROUNDS):
            for name in names if r % 2 == 0 else names[::-1]:
                times[name].append(steps(*runs[name], name))
        stats = {name: dict(runs[name][1].stats) for name in contenders}
        for _, opt in runs.values():
            opt.close()
    n_params = sum(p.numel() for p in reference.parameters())
    paired = {name: [s / u for s, u in zip(times[name], times[peer_of[name]], strict=True)] for name in contenders}
    ms = {name: round(1000 * median(t), 2) for name, t in times.items()}
    cpu_ms = {name: 1000 * (t.seconds + d.seconds) / cpu_steps[name] for name, (t, d) in cpu.items()}
    return record(
        "stream_overhead",
        ours=ms["streamed"],
        peer=ms["unstreamed"],
        unit="ms/step",
        target=1.15,
        higher_is_better=False,
        ratio=median(paired["streamed"]),
        extra={
            "ratio_spread": spread(paired["streamed"]),
            "ms_per_step": ms,
            "ratio_no_prefetch": round(median(paired["streamed_no_prefetch"]), 3),
            "ratio_apply_on_push": round(median(paired["streamed_apply_on_push"]), 3),
            # Both trainers with one shard a block: the streamed step's requests cut to a third.
            "ratio_block_shards": round(median(paired["streamed_block_shards"]), 3),
            "ratio_block_shards_spread": spread(paired["streamed_block_shards"]),
            # Both trainers on a daemon at SCHED_IDLE (server.scheduling): whether the daemon's
            # work taking a core in the middle of the trainer's torch ops is what the step adds.
            "ratio_idle_daemon": round(median(paired["streamed_idle_daemon"]), 3),
            "ratio_idle_daemon_spread": spread(paired["streamed_idle_daemon"]),
            # Each trainer on the idle daemon against itself on the default one, round by round.
            "idle_daemon_step_ratio": {
                kind: round(median([a / b for a, b in zip(times[f"{kind}_idle_daemon"], times[kind], strict=True)]), 3)
                for kind in ("streamed", "unstreamed")
            },
            "pull_stats": stats,
            # CPU per step of the trainer and the daemon, user and system, and their minor page
            # faults: the two share the machine's cores, so this is what a step's time is made of.
            "cpu_per_step": {
                name: {
                    who: {
                        "user_ms": round(1000 * c.user / cpu_steps[name], 1),
                        "system_ms": round(1000 * c.system / cpu_steps[name], 1),
                        "minor_faults": c.minor_faults // cpu_steps[name],
                    }
                    for who, c in zip(("trainer", "daemon"), pair, strict=True)
                }
                for name, pair in cpu.items()
            },
            # The daemon's requests (pulls and pushes, one per shard, an APPLY counted as a push) per step, and
            # its CPU per request: a streamed step pulls each block twice and pushes it in parts.
            "daemon_requests_per_step": {name: round(n / cpu_steps[name], 1) for name, n in requests.items()},
            # The trainer's round trips to the daemon per step (LocalClient.round_trips): a daemon's
            # shards of a block, or a step's APPLYs, go as one batch.
            "round_trips_per_step": {name: round(n / cpu_steps[name], 1) for name, n in trips.items()},
            "daemon_cpu_ms_per_request": {
                name: round(1000 * cpu[name][1].seconds / max(1, requests[name]), 2) for name in requests
            },
            # The share of the machine's core time that was busy in each phase (whatever ran):
            # below 1, a phase leaves cores idle that its work could have used.
            "cores_busy": {
                name: {phase: round(t.busy, 3) for phase, t in by_phase.items()}
                for name, by_phase in cores.items()
                if name
            },
            # What streaming adds to a step over its peer's (ms): wall time; CPU time, the trainer's
            # and the daemon's together, and that spread over the machine's cores (the least wall
            # time it could take with nothing else running); and the training thread's waits on
            # the wire (pulls, pushes, step()'s APPLY round, over the peer's step phase): latency
            # prefetch and the window did not hide.
            "overhead_split_ms": {
                name: {
                    "wall": round(ms[name] - ms[peer_of[name]], 1),
                    "cpu": round(cpu_ms[name] - cpu_ms[peer_of[name]], 1),
                    "cpu_over_cores": round((cpu_ms[name] - cpu_ms[peer_of[name]]) / (os.cpu_count() or 1), 1),
                    "waits": {
                        key.removesuffix("_seconds"): round(1000 * v / cpu_steps[name], 1)
                        for key, v in waited[name].items()
                    },  # fmt: skip
                    "peer_step_phase": round(1000 * median(phases[peer_of[name]]["step"]), 1),
                }
                for name in contenders
            },
            # Where a step's time goes (medians over the rounds): what a miss is made of.
            "phase_ms": {
                name: {phase: round(1000 * median(v), 1) for phase, v in split.items()}
                for name, split in phases.items()
                if name
            },
        },
        notes=f"{n_params / 1e6:.2f}M-param GPT ({CONFIG.n_layer} blocks, n_embd {CONFIG.n_embd}), fp32, batch "
        f"{BATCH} x {CONFIG.block_size}, window 2 blocks, one local daemon, shards of {SHARD_BYTES} B (the "
        f"_block_shards pair: {BLOCK_SHARD_BYTES} B; the _idle_daemon pair: a second daemon at SCHED_IDLE); {ROUNDS} "
        f"rounds of {STEPS_PER_ROUND} steps, order alternating; ratio: median of per-round ratios",
    )


if __name__ == "__main__":
    main()
