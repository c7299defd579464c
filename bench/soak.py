"""`make soak`: the daemon under the faults of issue #15, each phase bounded (6-15 minutes
here), the figures in bench/results/reliability/soak.json (docs/reliability.md quotes them).

1. kills: a trainer trains through at least 100 daemon deaths on one NVMe tier, half of them
   forced at a point of the commit protocol (PS_OFFLOAD_CRASH_AT, cycling over all five),
   half SIGKILLs at a random moment after a step; each restart is on the same port. Then the
   daemon's state is compared with torch.optim.AdamW run in process over the same batches:
   updates lost (shards behind the trainer's step) and parameters not bit-identical.
2. fuzz: the fuzz suite (tests/integration/test_fuzz.py) at 1,500 examples per property.
3. load: 1,000 gRPC pulls and 1,000 data plane pulls waiting for a version that never
   comes, and 3,000 idle data plane connections held open, while health is asked 200 times;
   its latency against the same daemon idle, asked the same way in the same run; the
   daemon's threads idle and loaded; and a training step taken under that load.
4. partition: a daemon in a network namespace (bench/netns.py); training through loss and a
   rate limit, then a 10 s partition, ends bit-identical; then a permanent partition: how long
   until the job fails, and whether the error names the daemon. Skipped (and said) without root.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import netns
from bench.common import QUICK, REPO, RESULTS, quick
from ps_offload import trainer
from ps_offload.daemon.local import LocalDaemon
from ps_offload.daemon.tiers.crash_points import ENV as CRASH_ENV
from ps_offload.daemon.tiers.crash_points import POINTS
from ps_offload.proto import ps_pb2, ps_pb2_grpc
from ps_offload.proto.channel import method_path
from ps_offload.proto.frames import send_message
from ps_offload.trainer.debug_models import mlp
from ps_offload.trainer.wire.daemon_client import DaemonError

SHARD_BYTES = 4096  # 7 shards: several commits per step, so a crash point lands mid-step


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 32, generator=g)
    return x, torch.randint(0, 10, (16,), generator=g)


def _step(opt, model, step: int) -> None:
    x, y = _batch(step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _reference(initial, steps: int):
    model = copy.deepcopy(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _offload(model, address: str, **client):
    return trainer.offload(
        model, daemons=[address], optimizer=trainer.AdamW(lr=1e-2, weight_decay=0.1),
        config=trainer.OffloadConfig(shard_bytes=SHARD_BYTES),
        client=trainer.ClientConfig(backoff_seconds=0.05, **client),
    )  # fmt: skip


def _mismatches(model, reference) -> int:
    return sum(not torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def _versions_behind(address: str, step: int) -> int:
    with grpc.insecure_channel(address) as channel:
        shards = ps_pb2_grpc.AdminStub(channel).ListShards(ps_pb2.ListShardsRequest(model="model"), timeout=30).shards
    return sum(s.version != step for s in shards)


# -- 1. kills ---------------------------------------------------------------------------


def kills(workdir: Path, target: int) -> dict:
    nvme, rng = workdir / "nvme", random.Random(0)
    torch.manual_seed(0)
    model = mlp((32, 64, 64, 10))
    initial = copy.deepcopy(model)
    progress, stop = threading.Condition(), threading.Event()
    deaths: Counter[str] = Counter()

    def start(k: int, *extra: str) -> tuple[LocalDaemon, str]:
        """Daemon k: even ones crash themselves at a point of a commit, odd ones are killed;
        the one after the last death lives, so that the trainer can finish on it."""
        how = POINTS[(k // 2) % len(POINTS)] if k % 2 == 0 else "sigkill"
        if k >= target:
            how = "lives"
        env = {CRASH_ENV: f"{how}@{rng.randint(1, 7)}"} if how not in ("sigkill", "lives") else None
        daemon = LocalDaemon(workdir / f"d{k}", "--nvme-dir", str(nvme), "--log-level", "WARNING", *extra, env=env)
        return daemon, how

    daemons = [start(0)]
    listen = ("--listen", f"127.0.0.1:{daemons[0][0].port}")
    steps_done = [0]

    def killer() -> None:
        while sum(deaths.values()) < target:
            daemon, how = daemons[-1]
            if how == "sigkill":
                with progress:  # after the trainer has stepped on this daemon
                    seen = steps_done[0]
                    progress.wait_for(lambda seen=seen: steps_done[0] > seen, timeout=300)
                time.sleep(rng.uniform(0, 0.05))
                daemon.process.send_signal(signal.SIGKILL)
            code = daemon.process.wait(timeout=300)
            assert code == -signal.SIGKILL, f"daemon died with {code}:\n{daemon.log()[-2000:]}"
            deaths[how] += 1
            daemons.append(start(len(daemons), *listen))
        stop.set()

    started = time.perf_counter()
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()  # before the initial values are pushed: daemon 0 may crash while taking them
    with _offload(model, daemons[0][0].address, retry_seconds=120) as opt:
        while not stop.is_set():
            _step(opt, model, opt.step_count)
            with progress:
                steps_done[0] = opt.step_count
                progress.notify_all()
        opt.synchronize()
        steps = opt.step_count
    thread.join(timeout=60)
    seconds = time.perf_counter() - started
    reference = _reference(initial, steps)
    last = daemons[-1][0]
    result = {
        "deaths": sum(deaths.values()),
        "by_point": dict(deaths),
        "steps": steps,
        "updates_lost": _versions_behind(last.address, steps),
        "params_not_bit_identical": _mismatches(model, reference),
        "param_tensors": len(list(model.parameters())),
        "seconds": round(seconds, 1),
    }
    for daemon, _ in daemons:
        daemon.kill()
    return result


# -- 2. fuzz ----------------------------------------------------------------------------


def fuzz(examples: int) -> dict:
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o", "timeout=3600",
         "tests/integration/test_fuzz.py"],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "FUZZ_EXAMPLES": str(examples)},
    )  # fmt: skip
    found = re.search(r"fuzz: (\d+) requests", run.stdout)
    passed = re.search(r"(\d+) passed", run.stdout)
    failed = re.search(r"(\d+) failed", run.stdout)
    return {
        "examples_per_property": examples,
        "requests": int(found.group(1)) if found else 0,
        "properties_passed": int(passed.group(1)) if passed else 0,
        "properties_failed": int(failed.group(1)) if failed else 0,
        "exit_code": run.returncode,
        "seconds": round(time.perf_counter() - started, 1),
    }


# -- 3. load ----------------------------------------------------------------------------


def _health_latencies(address: str, count: int) -> tuple[list[float], int]:
    latencies, failures = [], 0
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected before timing
        for _ in range(count):
            started = time.perf_counter()
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                failures += answer.status != health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                failures += 1
            latencies.append(time.perf_counter() - started)
    return latencies, failures


def _percentiles(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def load(workdir: Path, pulls: int, connections: int, checks: int) -> dict:
    """`pulls` waiting on gRPC and as many parked on the data plane, and `connections` idle
    data plane connections, all from 127.0.0.1 (so the per-client limits are raised to fit):
    health's latency against the daemon idle, its threads, and a training step meanwhile."""
    config = workdir / "load.toml"
    room = connections + pulls + 64
    config.write_text(f"[server]\nmax_data_connections = {room}\nmax_data_connections_per_client = {room}\n")
    daemon = LocalDaemon(workdir / "load", "--config", str(config), "--log-level", "WARNING")
    try:
        torch.manual_seed(0)
        model = mlp((32, 64, 64, 10))
        with _offload(model, daemon.address) as opt:
            _step(opt, model, 0)
            opt.synchronize()
            idle, idle_failures = _health_latencies(daemon.address, checks)
            threads_idle = _threads(daemon.process.pid)
            with grpc.insecure_channel(daemon.address) as admin:
                data_port = _data_port(admin)
                held = [socket.create_connection(("127.0.0.1", data_port), timeout=10) for _ in range(connections)]
                parked = [_parked_pull(data_port) for _ in range(pulls)]
                pull = admin.unary_stream(
                    method_path("ParameterServer", "Pull"),
                    request_serializer=ps_pb2.PullRequest.SerializeToString,
                    response_deserializer=bytes,
                )
                never = ps_pb2.PullRequest(model="model", shard_id=0, min_version=10**9)
                calls = [pull(never, timeout=600) for _ in range(pulls)]
                outcomes = Counter()
                waiter = threading.Thread(target=_drain, args=(calls, outcomes), daemon=True)
                waiter.start()
                loaded, loaded_failures = _health_latencies(daemon.address, checks)
                stats = ps_pb2_grpc.AdminStub(admin).Stats(ps_pb2.StatsRequest(), timeout=30)
                threads_loaded = _threads(daemon.process.pid)
                started = time.perf_counter()
                _step(opt, model, 1)  # its pushes and pulls past every waiting pull
                opt.synchronize()
                step_seconds = time.perf_counter() - started
                for call in calls:
                    call.cancel()
                waiter.join(timeout=60)
                for sock in held + parked:
                    sock.close()
        return {
            "waiting_pulls_sent": pulls,
            "pulls_waiting_at_once": stats.pulls_waiting,
            "pulls_refused": stats.pulls_refused_waiting,
            "data_plane_pulls_waiting": stats.data_pulls_waiting,
            "idle_connections": connections,
            "data_connections_open": stats.data_connections,
            "daemon_threads_idle": threads_idle,
            "daemon_threads_loaded": threads_loaded,
            "training_step_under_load_seconds": round(step_seconds, 3),
            "health_checks": checks,
            "health_idle": {**_percentiles(idle), "failures": idle_failures},
            "health_loaded": {**_percentiles(loaded), "failures": loaded_failures},
            "p99_ratio_loaded_vs_idle": round(_percentiles(loaded)["p99_ms"] / _percentiles(idle)["p99_ms"], 2),
            "pull_outcomes": dict(outcomes),
        }
    finally:
        daemon.kill()


def _parked_pull(data_port: int) -> socket.socket:
    """A data plane pull of a version that never comes: parked by the daemon, holding no thread."""
    sock = socket.create_connection(("127.0.0.1", data_port), timeout=10)
    request = ps_pb2.DataRequest(pull=ps_pb2.PullRequest(model="model", shard_id=0, min_version=10**9))
    request.timeout_ms = 600_000
    send_message(sock, request)
    return sock


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))


def _data_port(channel: grpc.Channel) -> int:
    """The daemon's data plane port, as a trainer learns it: registering the same spec again."""
    spec = ps_pb2_grpc.AdminStub(channel).GetModel(ps_pb2.GetModelRequest(model="model"), timeout=10).spec
    register = ps_pb2_grpc.ParameterServerStub(channel).RegisterModel
    return register(ps_pb2.RegisterModelRequest(spec=spec, daemon_index=0), timeout=10).data_port


def _drain(calls, outcomes: Counter) -> None:
    for call in calls:
        try:
            for _ in call:
                pass
            outcomes["answered"] += 1
        except grpc.RpcError as exc:
            outcomes[exc.code().name] += 1


# -- 4. partition -----------------------------------------------------------------------


def partition(workdir: Path, seconds: float, steps: int) -> dict:
    why_not = netns.unavailable()
    if why_not:
        return {"skipped": why_not}
    torch.manual_seed(0)
    model = mlp((32, 64, 64, 10))
    initial = copy.deepcopy(model)
    with netns.namespace("ps-soak", "10.212.0") as ns:
        args = ("--nvme-dir", str(workdir / "pnvme"), "--insecure", "--log-level", "WARNING")
        daemon = LocalDaemon(workdir / "p", *args, host=ns.ns_ip, launcher=ns.launcher)
        try:
            stalls = []
            with _offload(model, daemon.address, retry_seconds=60) as opt:
                degraded = ""
                for step in range(steps):
                    if step == steps // 4:
                        degraded = ns.degrade(loss=0.02, delay_ms=5, rate="50mbit")
                    if step == steps // 2:
                        ns.restore()
                        ns.partition()
                        threading.Timer(seconds, ns.heal).start()
                        cut = time.perf_counter()
                    _step(opt, model, step)
                    if step == steps // 2:
                        stalls.append(time.perf_counter() - cut)
                opt.synchronize()
            survived = {
                "partition_seconds": seconds,
                "step_during_partition_took_s": round(stalls[0], 1),
                "degraded_link": degraded,
                "steps": steps,
                "params_not_bit_identical": _mismatches(model, _reference(initial, steps)),
            }
            # Gone for good: the job fails within dead_peer_seconds + retry_seconds, naming it.
            with _offload(model, daemon.address, retry_seconds=15) as opt:
                ns.partition()
                started = time.perf_counter()
                try:
                    _step(opt, model, steps)
                    named, failed_after = False, None
                except DaemonError as exc:
                    named, failed_after = daemon.address in str(exc), time.perf_counter() - started
                ns.heal()
            return {
                **survived,
                "gone_for_good": {
                    "dead_peer_seconds": 10.0, "retry_seconds": 15.0, "job_failed_after_s": _round(failed_after),
                    "error_names_daemon": named,
                },
            }  # fmt: skip
        finally:
            daemon.kill()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def main() -> None:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ps-soak-", dir=REPO) as tmp:  # the work disk: O_DIRECT works
        workdir = Path(tmp)
        result = {
            "kills": kills(workdir / "kills", quick(100, 6)),
            "fuzz": fuzz(quick(1500, 20)),
            "load": load(workdir, quick(1000, 50), quick(3000, 100), quick(200, 20)),
            "partition": partition(workdir, quick(10.0, 2.0), quick(40, 12)),
        }
    result.update(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        seconds=round(time.perf_counter() - started, 1),
        **({"quick": True} if QUICK else {}),
    )
    # Beside the benchmarks' records, not among them: this one has no peer and no ratio (the
    # docs/benchmarks.md table is built from bench/results/*.json).
    out = RESULTS / "reliability"
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
