"""A replicated model's holder killed at a chosen point inside `opt.step()` (issue 39): a few
runs in `make test` (tests/integration/test_replica_kills.py), RUNS in `make soak`
(`python -m bench.replica_kills`: bench/results/reliability/replica_kills.json, which
docs/reliability.md quotes).

Each run starts three fresh NVMe daemons, trains a small transformer on torch's own encoder
layers (the model of issue 39's silent wrong step) with OffloadConfig(replicas=2)
over them, and SIGKILLs one daemon (its NVMe directory deleted: the node is gone for good) at
a point named by a `KillPlan`: before the step's pushes, as its nth push leaves, once its nth
push is acknowledged, as its nth pull leaves, while the step's pulls land (a timer after
`step()` returned), or while a replacement is caught up (the replacement itself, or the live
holder a shard is copied from). The kill is made on the thread about to make the call, so it
lands exactly there, and the call then meets a dead daemon.

A run must end one of two ways: bit for bit where torch.optim.AdamW(fused=True) in process
ends over the same batches, or with an error naming the shards it cannot go on without. A run
that ends otherwise (different values, or an error that names no shard) is the silent wrong
result the runs are here to find.

The calls are observed by wrapping the transports' methods for the run (the daemons, the
disk and the sockets are real): `Observed` sees every push and pull of every transport, the
repair's STATE pushes (over gRPC) included, with the daemon index it goes to. A third of the
pulls are held back at random by up to JITTER_SECONDS, so that the next forward meets pulls
still in flight in every order (what a loaded node does to them).
"""

from __future__ import annotations

import contextlib
import copy
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.proto import ps_pb2
from ps_offload.trainer.wire.daemon_client import DaemonClient
from ps_offload.trainer.wire.dataplane_client import DataPlaneClient
from ps_offload.trainer.wire.local_client import LocalClient

STEPS = 10
KILL_STEP_RANGE = (2, 6)  # the step whose step() the kill lands in
REPLACE_AFTER = 2  # repair points: the replacement comes this many steps after the loss
DEAD_PEER_SECONDS = 1.0
SHARD_BYTES = 4096
VOCAB, CONTEXT, WIDTH, BATCH = 32, 16, 32, 4
JITTER_SECONDS = 0.01  # pulls held back at random by up to this: the next forward meets them in flight
POINTS = ("before_push", "push_sent", "push_acked", "pull_sent", "pulls_landing", "repair_target", "repair_source")
"""Where in a step the holder dies (see the module docstring)."""


@dataclass(frozen=True)
class KillPlan:
    transport: str  # "local" (shared memory) or "tcp" (the data plane)
    point: str  # one of POINTS
    victim: int  # the daemon killed (for the repair points: the daemon lost first, then replaced)
    step: int  # the step whose step() the kill lands in
    nth: int  # which call of the point's kind in that step triggers it (1-based)
    delay: float  # pulls_landing: seconds after step() returned
    jitter: int  # seeds the pulls held back at random (up to JITTER_SECONDS, one in three)

    @classmethod
    def draw(cls, rng: random.Random, transport: str, point: str) -> KillPlan:
        return cls(
            transport=transport,
            point=point,
            victim=rng.randrange(3),
            step=rng.randint(*KILL_STEP_RANGE),
            nth=rng.randint(1, 12),
            delay=rng.uniform(0.0, 0.03),
            jitter=rng.randrange(1 << 30),
        )

    def __str__(self) -> str:
        return f"{self.point} on {self.transport}: daemon {self.victim} at step {self.step}, call {self.nth}" + (
            f", {self.delay * 1000:.1f} ms after step()" if self.point == "pulls_landing" else ""
        )


@dataclass
class Outcome:
    exact: bool  # the run ended with every parameter bit for bit torch's
    error: str  # what the run raised ("" when it trained to the end)
    killed: list[int]  # daemons killed, in order
    lost: list[int]  # daemons the trainer had left out at the end

    @property
    def loud_and_named(self) -> bool:
        """An error that names the shards the job lost and the way back."""
        return bool(self.error) and "shard" in self.error and "lost" in self.error


class SmallTransformer(nn.Module):
    """A causal language model on torch's own encoder layers: their attention reads
    `out_proj`'s parameters without calling it (trainer/offload/forward_waits.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.head(self.layers(self.emb(x) + self.pos[: x.size(1)], mask=mask, is_causal=True))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(VOCAB, (BATCH, CONTEXT + 1), generator=g) for _ in range(STEPS)]


def initial_model() -> SmallTransformer:
    torch.manual_seed(5)
    return SmallTransformer()


def loss_of(model: SmallTransformer, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def reference() -> list[torch.Tensor]:
    """Every parameter after STEPS steps of torch's fused AdamW, in process."""
    model = copy.deepcopy(initial_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    for batch in batches():
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class Observed:
    """For the run's duration, every transport call of the trainer goes through `on_call(kind,
    daemon, stage)` first (stage "before") and after its answer (stage "after"): kind "push",
    "pull" or "state" (a repair's STATE push), daemon the index it goes to, found by identity
    among the client's transports and gRPC clients."""

    def __init__(self, on_call: Callable[[str, int, str], None]) -> None:
        self.on_call = on_call
        self.client = None  # the ShardedClient, once built

    def index(self, transport: object) -> int:
        client = self.client
        if client is None:
            return -1
        for index in range(len(client.daemons)):
            if client.transports[index] is transport or client.transports.clients[index] is transport:
                return index
        return -1

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved = []
        for cls in (DaemonClient, DataPlaneClient, LocalClient):
            for name in ("push", "pull_into"):
                original = cls.__dict__[name]
                saved.append((cls, name, original))
                setattr(cls, name, self._wrap(original, name))
        try:
            yield
        finally:
            for cls, name, original in saved:
                setattr(cls, name, original)

    def _wrap(self, original, name: str):
        observed = self

        def call(transport, *args, **kwargs):
            kind = "pull"
            if name == "push":
                push = args[0]
                kind = "state" if push.header.kind == ps_pb2.STATE else "push"
            index = observed.index(transport)
            observed.on_call(kind, index, "before")
            answer = original(transport, *args, **kwargs)
            observed.on_call(kind, index, "after")
            return answer

        return call


class KillRun:
    """One run of a KillPlan in `workdir`."""

    def __init__(self, plan: KillPlan, workdir: Path) -> None:
        self.plan = plan
        self.workdir = workdir
        self.daemons: list[LocalDaemon] = []
        self.dirs: list[Path] = []
        self.killed: list[int] = []
        self.step = -1
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._armed = False  # a repair point's trigger counts from the replacement on
        self._jitter = random.Random(plan.jitter)
        self.replacement: LocalDaemon | None = None

    def _start(self, name: str) -> tuple[LocalDaemon, Path]:
        nvme = self.workdir / f"nvme-{name}"
        return LocalDaemon(self.workdir / name, "--nvme-dir", str(nvme), "--create-nvme-dir"), nvme

    def _kill(self, index: int, daemon: LocalDaemon, nvme: Path) -> None:
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(timeout=30)
        shutil.rmtree(nvme, ignore_errors=True)
        self.killed.append(index)

    def _on_call(self, kind: str, index: int, stage: str) -> None:
        plan = self.plan
        if (kind, stage) == ("pull", "before"):
            with self._lock:
                pause = self._jitter.uniform(0.0, JITTER_SECONDS) if self._jitter.random() < 1 / 3 else 0.0
            time.sleep(pause)
        with self._lock:
            if self.step != plan.step or (plan.point.startswith("repair") and not self._armed):
                return
            wanted = {
                "push_sent": ("push", "before"),
                "push_acked": ("push", "after"),
                "pull_sent": ("pull", "before"),
                "repair_target": ("state", "before"),
                "repair_source": ("pull", "before"),
            }.get(plan.point)
            if wanted != (kind, stage):
                return
            key = f"{kind}-{stage}"
            self.counts[key] = self.counts.get(key, 0) + 1
            if self.counts[key] != plan.nth:
                return
            self._armed = False
            self.counts[key] = -(10**9)  # once
            if plan.point == "repair_target":
                self._kill(plan.victim, self.replacement, self.workdir / "nvme-replacement")
            elif plan.point == "repair_source":
                # The daemon the repair is pulling from: every other shard of the lost one's
                # now has no holder left, which must fail the step naming them.
                self._kill(index, self.daemons[index], self.dirs[index])
            else:
                self._kill(plan.victim, self.daemons[plan.victim], self.dirs[plan.victim])

    def run(self) -> Outcome:
        plan = self.plan
        with ThreadPoolExecutor(3) as pool:  # fresh daemons every run: started side by side
            started = list(pool.map(self._start, [f"d{i}" for i in range(3)]))
        self.daemons, self.dirs = [d for d, _ in started], [n for _, n in started]
        observed = Observed(self._on_call)
        error = ""
        model = copy.deepcopy(initial_model())
        try:
            with observed.installed():
                opt = trainer.offload(
                    model,
                    daemons=[d.address for d in self.daemons],
                    optimizer=trainer.AdamW(lr=1e-3, weight_decay=0.01),
                    config=trainer.OffloadConfig(shard_bytes=SHARD_BYTES, replicas=2),
                    client=trainer.ClientConfig(transport=plan.transport, dead_peer_seconds=DEAD_PEER_SECONDS),
                )
                observed.client = opt.client
                with opt:
                    self._train(opt, model)
        except Exception as exc:  # noqa: BLE001 - the outcome says what it was
            error = f"{type(exc).__name__}: {exc}"
        finally:
            for daemon in [*self.daemons, *([self.replacement] if self.replacement else [])]:
                daemon.kill()
        expected = reference_cache()
        exact = not error and all(torch.equal(p, q) for p, q in zip(model.parameters(), expected, strict=True))
        lost = sorted(observed.client.holders.lost) if observed.client is not None else []
        return Outcome(exact=exact, error=error, killed=list(self.killed), lost=lost)

    def _train(self, opt, model) -> None:
        plan = self.plan
        repairing = plan.point.startswith("repair")
        timer = None
        for step, batch in enumerate(batches()):
            if repairing and step == plan.step - REPLACE_AFTER:
                self._kill(plan.victim, self.daemons[plan.victim], self.dirs[plan.victim])
            if repairing and step == plan.step:
                self.replacement, _ = self._start("replacement")
                opt.replace_daemon(self.daemons[plan.victim].address, self.replacement.address)
            opt.zero_grad()
            loss_of(model, batch).backward()
            with self._lock:
                self.step = step
                self._armed = repairing and step == plan.step
            if plan.point == "before_push" and step == plan.step:
                self._kill(plan.victim, self.daemons[plan.victim], self.dirs[plan.victim])
            opt.step()
            if plan.point == "pulls_landing" and step == plan.step:
                victim = plan.victim
                timer = threading.Timer(plan.delay, self._kill, (victim, self.daemons[victim], self.dirs[victim]))
                timer.start()  # while the pulls land and the next forward waits for them
        opt.synchronize()
        if timer is not None:
            timer.join()


_REFERENCE: list[torch.Tensor] | None = None


def reference_cache() -> list[torch.Tensor]:
    global _REFERENCE
    if _REFERENCE is None:
        _REFERENCE = reference()
    return _REFERENCE


def plans(runs: int, seed: int) -> list[KillPlan]:
    """`runs` plans, the points in turn and the transports alternating, the rest drawn from `seed`."""
    rng = random.Random(seed)
    return [KillPlan.draw(rng, ("local", "tcp")[i % 2], POINTS[i % len(POINTS)]) for i in range(runs)]


def expected(plan: KillPlan, outcome: Outcome) -> bool:
    """A holder killed inside a step ends bit for bit with torch; a second holder killed while
    a repair copies from it leaves the lost daemon's other shards with no holder: loud, naming
    them."""
    return outcome.loud_and_named if plan.point == "repair_source" else outcome.exact


RUNS = 300
SEED = 39


def main(runs: int = RUNS, seed: int = SEED) -> dict:
    import json
    import tempfile

    from bench.common import RESULTS, machine, quick

    runs = quick(runs, len(POINTS))
    tally: dict[str, dict[str, int]] = {}
    wrong: list[str] = []
    started = time.monotonic()
    for plan in plans(runs, seed):
        with tempfile.TemporaryDirectory(prefix="ps-soak-kills-") as workdir:
            outcome = KillRun(plan, Path(workdir)).run()
        verdict = "exact" if outcome.exact else "loud" if outcome.loud_and_named else "wrong"
        counts = tally.setdefault(f"{plan.point}/{plan.transport}", {"exact": 0, "loud": 0, "wrong": 0})
        counts[verdict] += 1
        if not expected(plan, outcome):
            wrong.append(f"{plan}: {verdict} {outcome.error[:300]}")
        print(f"{verdict:5} {plan}", flush=True)
    result = {
        "runs": runs,
        "seed": seed,
        "seconds": round(time.monotonic() - started, 1),
        "by_point": tally,
        "unexpected": wrong,
        "machine": machine(),
        "notes": (
            "three fresh NVMe daemons per run, replicas=2, a small transformer on torch's encoder layers, "
            f"{STEPS} steps of AdamW; one holder SIGKILLed (its directory deleted) at the point named; a third "
            f"of the pulls held back by up to {JITTER_SECONDS * 1000:g} ms"
        ),
    }
    out = RESULTS / "reliability"
    out.mkdir(parents=True, exist_ok=True)
    (out / "replica_kills.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    if wrong:
        raise SystemExit(f"{len(wrong)} runs did not end as they must: {wrong}")
    return result


if __name__ == "__main__":
    main()
