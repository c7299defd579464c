"""`make bench`: runs every benchmark, then rewrites the generated parts of docs/benchmarks.md
from bench/results/*.json (between the marker lines): the results table, and the paragraph
per benchmark that quotes its figures. Prose outside the markers quotes no measured figure,
so the doc cannot keep a number from an older run.

Each script's wall time is stored in its result files (`bench_seconds`) and printed at the end.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable

from bench import (
    audit_overhead,
    chart,
    compress_cpu,
    compress_gpu,
    compression_convergence,
    daemon_update,
    deepspeed_ops,
    fused_decompress_adamw,
    gpu_step_vs_torchao,
    nvme_io,
    nvme_train_step,
    optimizer_step,
    pipeline_efficiency,
    ps_overhead_pp_dp,
    pull_bytes_bf16,
    push_in_backward,
    replication_overhead,
    staleness_convergence,
    stream_commits,
    stream_overhead,
    train_step_overhead,
    train_step_overhead_bf16,
    transport,
    transport_local,
    zero_infinity,
)
from bench.common import QUICK, REPO, RESULTS

DOC = REPO / "docs" / "benchmarks.md"
CHART = REPO / "docs" / "benchmarks.svg"
MARKERS = {
    "results": ("<!-- results:begin -->", "<!-- results:end -->"),
    "status": ("<!-- status:begin -->", "<!-- status:end -->"),
}


def _results() -> dict[str, dict]:
    return {r["name"]: r for r in (json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json")))}


def _spread(r: dict) -> str:
    s = r.get("ratio_spread")
    return f"{s['min']}–{s['max']} ({s['n']})" if s else ""


def table(results: dict[str, dict]) -> str:
    rows = [
        "| benchmark | ours | peer | unit | ratio | spread (n) | target | met | date | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        target = f"{'≥' if r['higher_is_better'] else '≤'} {r['target']}"
        rows.append(
            f"| `{r['name']}` | {r['ours']} | {r['peer']} | {r['unit']} | **{r['ratio']}** | {_spread(r)} | {target} | "
            f"{'yes' if r['target_met'] else 'no'} | {r['date']} | {r.get('bench_seconds', '')} |"
        )
    return "\n".join(rows)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _head(r: dict) -> str:
    target = f"{'≥' if r['higher_is_better'] else '≤'} {r['target']}"
    s = r.get("ratio_spread")
    spread = f", paired ratios {s['min']}–{s['max']} over {s['n']}" if s else ""
    machine = f", {r['machine']}" if r.get("machine") else ""
    return (
        f"**`{r['name']}` ({target}): {'met' if r['target_met'] else 'not met'}, {r['ratio']}×** "
        f"({r['ours']} against {r['peer']} {r['unit']}{spread}; {r['date']}{machine})."
    )


def _missing(r: dict) -> str:
    missing = r.get("peer_missing") or {}
    if isinstance(missing, list):
        missing = dict.fromkeys(missing, "not installed")
    return "".join(f" Peer missing in this run: {who} ({why})." for who, why in missing.items())


def _optimizer_step(r: dict) -> str:
    g = r["gparams_per_s"]
    parts = [f"ours {g['ours']}, torch fused AdamW {g['torch']}"]
    if "deepspeed" in g:
        parts.append(f"DeepSpeedCPUAdam {g['deepspeed']}")
    vs = "; ".join(
        f"against {who} alone {r[f'ratio_vs_{who}']}×" for who in ("torch", "deepspeed") if f"ratio_vs_{who}" in r
    )
    return f"G params/s: {', '.join(parts)} ({vs})."


def _transport(r: dict) -> str:
    text = (
        f"Over {r['connections']} connections: ours {r['ours']} GB/s, raw TCP in Python with the same connections "
        f"{r['raw_tcp_gbps']} GB/s (ours over it {r['ratio_vs_raw_tcp']}×)"
    )
    if r.get("iperf3_gbps") is not None:
        text += (
            f", iperf3 as {r['connections']} one-connection processes {r['iperf3_gbps']} GB/s"
            f" (ours over it {r['ratio_vs_iperf3']}×)"
        )
    return text + f"; the gRPC path {r['grpc_gbps']} GB/s."


def _transport_local(r: dict) -> str:
    text = (
        f"Over {r['connections']} local connections, into and out of a window shared with the daemon: pull "
        f"{r['pull_gbps']} GB/s ({r['ratio_pull']}× the copy), push {r['push_gbps']} GB/s ({r['ratio_push']}×); "
        f"one in-process copy_ {r['copy_gbps']} GB/s. Each moves the bytes once, as the copy does (the daemon "
        "writes the pull into the window under the read hold, and copies the push from it into the shard)"
    )
    if "pull_slot_gbps" in r:
        text += (
            f". The same buffers outside a window, through the connections' slots (one more copy, on the "
            f"trainer's side): pull {r['pull_slot_gbps']} GB/s ({r['ratio_pull_slot']}×), push "
            f"{r['push_slot_gbps']} GB/s ({r['ratio_push_slot']}×)"
        )
    return text + "."


def _nvme_io(r: dict) -> str:
    g = r["gbps"]
    peers = ", ".join(f"{who} {v}" for who, v in g.items() if who != "ours")
    vs = "; ".join(
        f"against {who} alone {r[f'ratio_vs_{who}']}×" for who in ("fio", "deepspeed") if f"ratio_vs_{who}" in r
    )
    text = f"{r['bytes'] >> 20} MiB: ours {g['ours']} GB/s, {peers} GB/s ({vs})."
    shared = r.get("flushes_shared", {})
    if "ratio_one_at_a_time" in r and r["name"] == "nvme_write":
        text += (
            f" Ours commits the {r['committers']} shards of a step at once, as a step's pushes arrive: they were "
            f"written in {shared['groups']} groups over the timed rounds ({shared['commits_per_group']} commits per "
            f"group, two fdatasyncs per group). One shard after another (one_at_a_time, a single stream of pushes): "
            f"{g['one_at_a_time']} GB/s, {r['ratio_one_at_a_time']}× the faster peer; such a commit took "
            f"{shared['commit_ms']} ms, its two fdatasyncs {shared['flush_ms']} ms each "
            f"({100 * shared['flush_share']:.1f}% of it)."
        )
    elif "ratio_one_at_a_time" in r:
        text += (
            f" Ours loads the {r['committers']} shards at once; one after another (one_at_a_time): "
            f"{g['one_at_a_time']} GB/s, {r['ratio_one_at_a_time']}× the faster peer."
        )
    if "ratio_to_bytes_only" in r:
        what = "headers and fdatasyncs" if r["name"] == "nvme_write" else "headers and crc32c checks"
        text += (
            f" What bounds it, measured in the same rounds: the same DirectIO moving the same bytes one shard after "
            f"another without the {what} (bytes_only) runs at {g['bytes_only']} GB/s, ours at "
            f"{r['ratio_to_bytes_only']}× of that, and bytes_only at {r['bytes_only_vs_faster_peer']}× the faster "
            "peer. The rest is the contract: a version is on disk, header and all, before its push is acknowledged, "
            "which ZeRO-Infinity's swapper does not promise."
        )
    return text


def _nvme_train_step(r: dict) -> str:
    return (
        f"Step time with prefetch {r['step_ms_nvme_prefetch']} ms, without {r['step_ms_nvme_no_prefetch']} ms, "
        f"all in RAM {r['step_ms_all_in_ram']} ms (medians over the rounds)."
    )


def _stream_commits(r: dict) -> str:
    over, per = r["over_unsynced"], r["per_step"]

    def asked(key: str) -> str:
        p = per[key]
        return f"{p['nvme_commits']:g} commits in {p['nvme_commit_groups']:g} groups, {p['nvme_flushes']:g} flushes"

    return (
        f"Over the unsynced daemon's step: side by side {over['durable_apply_at_step']['ratio']} (micro_batches=0), "
        f"{over['durable_apply_on_push']['ratio']} (micro_batches=1); one commit at a time "
        f"{over['in_order_apply_at_step']['ratio']} and {over['in_order_apply_on_push']['ratio']}. Per step, "
        f"micro_batches=0 side by side: {asked('durable_apply_at_step')}; one at a time: "
        f"{asked('in_order_apply_at_step')} ({r['shards']} shards)."
    )


def _scale(r: dict) -> str:
    phases = r["phase_seconds"]
    trainer, target = r["trainer_peak_rss_bytes"], r["trainer_rss_target_bytes"]
    return (
        f"A {r['params'] / 1e9:.2f}B-parameter GPT ({r['n_layer']} blocks of n_embd {r['n_embd']}), "
        f"{r['state_bytes'] / 1e9:.1f} GB of AdamW state, {r['state_bytes'] / r['physical_ram_bytes']:.2f}× physical "
        f"RAM, through one daemon with a {r['ram_tier_bytes'] / 2**30:.1f} GiB RAM tier: step {r['step_seconds']} s "
        f"(forward {phases['forward']}, backward {phases['backward']}, step {phases['step']}) against a disk bound of "
        f"{r['disk_bound_seconds']} s; losses {', '.join(map(str, r['losses']))}. The daemon moved "
        f"{r['bytes_moved_per_param']} bytes per parameter per step (the bound counts 24) at {r['moved_gbps']} GB/s. "
        f"Trainer peak RSS {trainer / 2**30:.2f} GiB (target ≤ {target / 2**30:.0f} GiB: "
        f"{'met' if trainer <= target else 'not met'}), daemon {r['daemon_peak_rss_bytes'] / 2**30:.2f} GiB; "
        f"created and pushed in {r['create_seconds']} s."
    )


def _fused(r: dict) -> str:
    b = r["bytes_per_element"]
    return (
        f"Less work, not faster code: ours moves {b['ours']} bytes per element, torch's AdamW {b['torch']}. Per byte "
        f"moved, ours runs at {r['ratio_per_byte']}× torch's rate ({r['gbytes_per_s']['ours']} against "
        f"{r['gbytes_per_s']['torch']} GB/s). Decompress-then-torch-ops: {r['decompress_then_torch_ops_ms']} ms "
        f"against ours {r['ours_ms']} ms ({r['ratio_vs_decompress_then_torch_ops']}×)."
    )


def _convergence(r: dict) -> str:
    finals = "; ".join(f"{name}: {', '.join(map(str, fs))}" for name, fs in r["final_loss_per_seed"].items())
    text = f"Seeds {', '.join(map(str, r['seeds']))}; final losses per seed, {finals}."
    if "bytes_per_step" in r:
        b = r["bytes_per_step"]
        text += f" Bytes pushed per step: fp32 {b['none']}, 1-bit {b['onebit']} ({r['bytes_ratio']}× fewer)."
    if "ms_per_step" in r:
        text += " ms/step: " + ", ".join(f"{k} {v}" for k, v in r["ms_per_step"].items()) + "."
    return text


def _train_step_overhead(r: dict) -> str:
    phases = r.get("phase_ms")
    if not phases:
        return ""
    return (
        "Per step, ms: "
        + "; ".join(f"{who}: " + ", ".join(f"{k} {v}" for k, v in p.items()) for who, p in phases.items())
        + "."
    )


def _audit_overhead(r: dict) -> str:
    return (
        f"{r['audits']} audits of one shard, {r['audit_ms']} ms each: {100 * r['audit_share']:.2f}% of the "
        f"{r['audit_every']} plain steps between two."
    )


def _pipeline(r: dict) -> str:
    rows = ", ".join(f"{x['schedule']} m={x['microbatches']}: {x['efficiency']:.3f}" for x in r["results"])
    head = next(x for x in r["results"] if x["schedule"] == "1f1b" and x["microbatches"] == max(
        y["microbatches"] for y in r["results"]))  # fmt: skip
    return (
        f"Efficiency by schedule: {rows}. 1F1B at the largest m: measured bubble {head['bubble_measured']:.3f} "
        f"against {head['bubble_theory']:.3f} in theory; compute per micro-batch inside the pipeline "
        f"{', '.join(f'{t:.1f}' for t in head['t_mb_in_pipeline_ms'])} ms against "
        f"{', '.join(f'{t:.1f}' for t in r['t_mb_ms'])} ms alone; against that in-pipeline compute the step is at "
        f"{head['efficiency_vs_in_pipeline_compute']:.3f} of ideal."
    )


def _ps_overhead(r: dict) -> str:
    return f"staleness=1: {r['staleness1_ms']} ms/step, {r['staleness1_ratio']}×."


def _compress_cpu(r: dict) -> str:
    return "Variants, ratio to their own copy: " + ", ".join(f"{k} {v['ratio']}" for k, v in r["methods"].items()) + "."


def _stream_overhead(r: dict) -> str:
    ms = ", ".join(f"{k} {v}" for k, v in r["ms_per_step"].items())
    text = (
        f"ms/step: {ms}. Without prefetch {r['ratio_no_prefetch']}×; applied on push (micro_batches=1) "
        f"{r['ratio_apply_on_push']}×."
    )
    if "phase_ms" in r:
        split = "; ".join(
            f"{name}: " + ", ".join(f"{phase} {v}" for phase, v in phases.items())
            for name, phases in r["phase_ms"].items()
            if name in ("unstreamed", "streamed")
        )
        text = text[:-1] + (
            f". Per step, ms: {split}. Both move their bytes in place through the node's daemon (windows); the "
            "streamed backward also pulls every block a second time, gathers each block's gradient out of "
            "`.grad`, and runs while the daemon accumulates the pushed parts on the same two cores."
        )
    if cpu := r.get("cpu_per_step"):
        used = "; ".join(
            f"{name}: " + ", ".join(
                f"{who} {c['user_ms']} user + {c['system_ms']} system ms, {c['minor_faults']} minor faults"
                for who, c in cpu[name].items()
            )
            for name in ("unstreamed", "streamed")
            if name in cpu
        )  # fmt: skip
        text += f" CPU per step (both processes on the same two cores): {used}."
    if requests := r.get("daemon_requests_per_step"):
        each = "; ".join(
            f"{name} {n} a step, {r['daemon_cpu_ms_per_request'][name]} ms of daemon CPU each"
            for name, n in requests.items()
            if name in ("unstreamed", "streamed")
        )
        text += f" The daemon's requests (pulls and pushes, one per shard): {each}."
    if trips := r.get("round_trips_per_step"):
        each = ", ".join(f"{name} {n}" for name, n in trips.items() if name in ("unstreamed", "streamed"))
        text += f" The trainer's round trips to it a step (a batch of a daemon's shards is one): {each}."
    if "ratio_block_shards" in r:
        low, high = r["ratio_block_shards_spread"]["min"], r["ratio_block_shards_spread"]["max"]
        text += (
            f" With one shard a block on both sides (a third of the streamed step's requests): "
            f"{r['ratio_block_shards']}× ({low}–{high})."
        )
    if "ratio_idle_daemon" in r:
        low, high = r["ratio_idle_daemon_spread"]["min"], r["ratio_idle_daemon_spread"]["max"]
        own = r["idle_daemon_step_ratio"]
        text += (
            f' Both on a daemon at SCHED_IDLE (`server.scheduling = "idle"`): {r["ratio_idle_daemon"]}× '
            f"({low}–{high}); each step on it against the same trainer's on the default daemon: streamed "
            f"{own['streamed']}×, unstreamed {own['unstreamed']}×."
        )
    if busy := r.get("cores_busy"):
        shares = "; ".join(
            f"{name}: " + ", ".join(f"{phase} {round(100 * v)}%" for phase, v in busy[name].items())
            for name in ("unstreamed", "streamed")
            if name in busy
        )
        text += f" The machine's cores busy, by phase: {shares}."
    if split := r.get("overhead_split_ms", {}).get("streamed"):
        waits = split["waits"]
        text += (
            f" What streaming adds to a step: {split['wall']} ms of wall time; {split['cpu']} ms of CPU, trainer and "
            f"daemon together ({split['cpu_over_cores']} ms spread over the cores); the training thread waited "
            f"{waits['pull_wait']} ms for pulls, {waits['push_wait']} ms for pushes and {waits['apply']} ms for "
            f"step()'s APPLY round (the peer's whole step phase: {split['peer_step_phase']} ms)."
        )
    return text


def _zero_infinity(r: dict) -> str:
    if "largest_n_layer" in r:  # python -m bench.zero_infinity --largest
        parts = []
        for who, label in (("ours", "ours"), ("deepspeed", "DeepSpeed")):
            n = r["largest_n_layer"][who]
            probe = r["probes"][who]
            failed = sorted(probe["failed"].items(), key=lambda kv: int(kv[0]))
            why = f", {failed[0][0]} blocks failed ({failed[0][1]})" if failed else ", none failed up to --max-layers"
            params = probe["trained"][str(n)]["params"]
            size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
            parts.append(f"{label} {size} parameters ({n} blocks{why})")
        return f"Largest trained, n_embd {r['n_embd']}, one step at batch 1: " + "; ".join(parts) + "."
    ms, rss, disk = r["ms_per_step"], r["peak_rss_bytes"], r["nvme_bytes"]
    text = (
        f"{r['params'] / 1e6:.1f}M parameters, {r['state_bytes'] / 1e9:.2f} GB of AdamW state, our daemon's RAM tier "
        f"{r['ours_ram_tier_bytes'] >> 20} MiB: ms/step ours {ms['ours']}, DeepSpeed {ms['deepspeed']}. Peak RSS ours "
        f"{rss['ours'] / 2**30:.2f} GiB (trainer and daemon), DeepSpeed {rss['deepspeed'] / 2**30:.2f} GiB; on disk "
        f"ours {disk['ours'] / 1e9:.2f} GB, DeepSpeed {disk['deepspeed'] / 1e9:.2f} GB; first-step loss ours "
        f"{r['first_loss']['ours']}, DeepSpeed {r['first_loss']['deepspeed']}."
    )
    if "bound_ratio" in r:
        low, high = r["bound_ratio_spread"]["min"], r["bound_ratio_spread"]["max"]
        text += (
            f" What bounds it: the same model's forward and backward alone, in RAM with no optimizer, took "
            f"{ms['compute']} ms a step in the same rounds, so no offload system could be more than "
            f"{r['bound_ratio']}× DeepSpeed here (paired {low}–{high}); ours takes {r['ours_over_compute']}× that "
            "compute. Both share the 2 cores between that compute and their optimizer and disk work."
        )
    if "ours_phase_ms" in r:
        text += _zero_infinity_profile(r)
    return text


def _zero_infinity_profile(r: dict) -> str:
    phase, daemon = r["ours_phase_ms"], r["ours_daemon_per_step"]
    state = r["state_bytes"]
    return (
        f" Ours per step: forward {phase['forward']} ms, backward {phase['backward']} ms (pushes applied as they "
        f"arrive), step() {phase['step']} ms; the daemon read {daemon['nvme_bytes_read'] / state:.2f}× and wrote "
        f"{daemon['nvme_bytes_written'] / state:.2f}× the AdamW state ({daemon['nvme_master_reads']:.0f} pulls read "
        f"a master from disk{_window_loads(daemon)}; {_bytes_per_param(r)}), its I/O threads busy "
        f"{daemon['nvme_read_seconds']} s reading and "
        f"{daemon['nvme_write_seconds']} s writing, its AdamW {daemon['optimizer_seconds']} s.{_cores_busy(r)}"
        f"{_commits_and_disk(r)}{_durable(r)}{_added_cpu(r)}"
    )


def _durable(r: dict) -> str:
    if "durable_over_unsynced" not in r:
        return ""
    low, high = r["durable_over_unsynced_spread"]["min"], r["durable_over_unsynced_spread"]["max"]
    return (
        f" Ours with `store.fsync = false` (no flush: safe from the daemon's crash, not a power cut, as DeepSpeed's "
        f"swapped state is not) took {r['ms_per_step']['ours_unsynced']} ms a step in the same rounds: durability "
        f"costs {r['durable_over_unsynced']}× (paired {low}–{high})."
    )


def _commits_and_disk(r: dict) -> str:
    """Group commit per step, the disk's busy share, and what the trainer waited for."""
    daemon = r["ours_daemon_per_step"]
    if "nvme_flushes" not in daemon:
        return ""  # a result from before the daemon counted its flushes
    busy, flushes, waits = r["disk_busy_share"], r["disk_flushes_per_step"], r["ours_waits_ms_per_step"]
    disk = (
        f" (DeepSpeed's writes flush nothing: the disk saw {flushes['deepspeed']} flushes a step in its blocks, "
        f"{flushes['ours']} in ours). The disk had I/O in flight {busy['ours']:.0%} of our steps' time and "
        f"{busy['deepspeed']:.0%} of DeepSpeed's."
        if busy is not None
        else " (the bench's directory had no block device under it to read the disk's busy time from)."
    )
    return (
        f" Commits per step: {daemon['nvme_commits']:.0f} in {daemon['nvme_commit_groups']:.0f} groups, "
        f"{daemon['nvme_flushes']:.0f} flushes taking {daemon['nvme_flush_seconds']} s{disk} The trainer waited "
        f"{waits['push_wait']} ms a step for pushes and {waits['pull_wait']} ms for pulls."
    )


def _added_cpu(r: dict) -> str:
    """The CPU ours adds to the compute's own (the trainer's beyond the compute process's, and
    the daemon's) against the time it adds: near 1, that CPU ran on cores the compute needed."""
    daemon, processes = r["ours_daemon_per_step"], r.get("process_per_step", {})
    if "cpu_seconds" not in daemon or "compute" not in processes:
        return ""
    cpu = {k: _process_ms(processes, k) for k in ("ours", "compute")}
    added_cpu = cpu["ours"] - cpu["compute"] + 1000 * daemon["cpu_seconds"]
    added_time = r["ms_per_step"]["ours"] - r["ms_per_step"]["compute"]
    busy = cpu["compute"] / r["ms_per_step"]["compute"] / r["threads"]
    return (
        f" Ours adds {added_time:.0f} ms a step to the compute's and {added_cpu:.0f} ms of CPU (the trainer's "
        f"{cpu['ours'] - cpu['compute']:.0f} beyond the compute process's, the daemon's "
        f"{1000 * daemon['cpu_seconds']:.0f}): {added_cpu / added_time:.2f} ms of CPU per ms added. The compute "
        f"alone keeps its {r['threads']} cores {busy:.0%} busy (its threads spinning included), so what else runs "
        "takes their time from it."
    )


def _cores_busy(r: dict) -> str:
    """Ours' CPU per step, trainer and daemon, against what the cores give a step."""
    daemon, processes = r["ours_daemon_per_step"], r.get("process_per_step", {})
    if "cpu_seconds" not in daemon or "ours" not in processes:
        return ""  # a result from before the daemon's CPU was recorded
    trainer = _process_ms(processes, "ours") / 1000
    cores = r["threads"] * r["ms_per_step"]["ours"] / 1000
    used = trainer + daemon["cpu_seconds"]
    return (
        f" CPU per step: the trainer {trainer:.2f} s and the daemon {daemon['cpu_seconds']:.2f} s, {used:.2f} of the "
        f"{cores:.2f} s its {r['threads']} cores give a step ({used / cores:.0%} busy)."
    )


def _process_ms(processes: dict, system: str) -> float:
    """A system's own process's CPU per step (user and system), from `process_per_step`."""
    return processes[system]["user_ms"] + processes[system]["system_ms"]


def _window_loads(daemon: dict) -> str:
    if "window_loads" not in daemon:
        return ""  # a result from before the residency window
    return f", {daemon['window_loads']:.0f} loaded the whole arena for the residency window"


def _bytes_per_param(r: dict) -> str:
    daemon, params = r["ours_daemon_per_step"], r["params"]
    moved = (daemon["nvme_bytes_read"] + daemon["nvme_bytes_written"]) / params
    ideal = 2 * r["state_bytes"] / params
    text = f"{moved:.1f} bytes moved per parameter per step, where the state read once and written once is {ideal:.1f}"
    if "ours_window" in r:
        window = r["ours_window"]
        text += (
            f" and, with the residency window this RAM tier allows ({window['window_bytes'] / 2**20:.0f} MiB, "
            f"{window['window_shards']} of {window['shards']} shards), {window['bound_bytes_per_param']}"
        )
    return text


def _nonfinite_check(r: dict) -> str:
    return (
        "What bounds it: the check reads the payload as it came, on every core, before the step may change "
        "anything (2 bytes an element for bf16 beside the one-pass step's 30: kernels/fused_step.py), so a refused "
        "push changes nothing; inside the step's own pass it would be free, but a NaN found there would leave the "
        "shard half updated, with nothing to restore it from on a RAM-only daemon. On by default all the same (a "
        "NaN would poison a shared model for every trainer, silently); `store.allow_nonfinite_pushes = true` turns "
        "it off."
    )


def _daemon_update_bf16_state(r: dict) -> str:
    n, ours_s, wide_s, peer_s = r["params"], r["ours"] / 1e3, r["fp32_state_ms"] / 1e3, r["peer"] / 1e3
    low, high = r["time_vs_fp32_state_spread"]["min"], r["time_vs_fp32_state_spread"]["max"]
    return (
        "The daemon steps bf16 state in one pass (kernels/bf16_state_step.py: p, m, v and the gradient read as bf16, "
        "the fp32 update, p, m, v and the pull written as bf16, bit for bit as torch's fused kernel on bf16 tensors; "
        "without a grad multiplier the gradient's round trip through fp32 and back, the identity, is skipped: the "
        "ratio was 0.753 on 2026-12-06 before). "
        "By bytes alone the ratio would stop at the target: per element torch's bf16 step reads p, g, m and v and "
        "writes p, m and v (14); ours adds the non-finite check's read of the gradient (2) and the pull it writes "
        f"(2): 14/18 = 0.78. Neither side is bound by memory here (torch's moves {14 * n / peer_s / 1e9:.1f} GB/s). "
        f"Against the same update with fp32 state in the same rounds ({r['fp32_state_ms']} ms), bf16 state takes "
        f"{r['time_vs_fp32_state']}× the time (paired {low}–{high}) for 18 bytes an element against 32 (ours "
        f"moves {18 * n / ours_s / 1e9:.1f} GB/s, the fp32 state's {32 * n / wide_s / 1e9:.1f} GB/s): bf16 state "
        "runs at the cores' arithmetic rate (a widening and a rounding per value), not memory's, so on these 2 "
        "cores it halves what a step holds, writes to NVMe and reads back far more than it shortens a RAM-resident "
        "update."
    )


def _daemon_update(r: dict) -> str:
    cases = r["cases"]
    text = "; ".join(
        f"{name}: ours {c['ours_ms']} ms (its non-finite check alone {c['check_ms']} ms), torch {c['peer_ms']} ms "
        f"({c['ratio']}×)"
        for name, c in cases.items()
    )
    return (
        f"Per step ({r['params'] / 1e6:.1f}M parameters): {text}. The daemon's step is one pass that also writes "
        "the pull the push carries (kernels/fused_step.py: the bf16 gradient read as it came, master, m and v read "
        "and written once, the new values rounded to bf16 into the trainer's buffer, bit for bit as torch's fused "
        "kernels; `bf16_pull_apart` is the same with the pull as a call of its own). What bounds it is bytes: per "
        "element torch's step moves 28 (an fp32 gradient, then p, m and v read and written); ours 30 (a bf16 "
        "gradient, p, m and v, the bf16 pull and the read its write allocates first) and the check's 2, so a "
        "memory-bound host caps the ratio near 28/32 = 0.875 with the check on. (`sgd` was 0.372 on 2026-12-06 "
        "before its loops that also write the pull were unswitched on momentum by hand: a store under a condition "
        "kept LLVM from vectorizing them.) `fp16` converts with the CPU's own instructions (F16C), where bf16's "
        "rounding is integer arithmetic with a NaN select in every lane (this CPU has no bf16 conversion): on "
        "these cores the one pass runs near its arithmetic rate, so that conversion shows." + _half_threads(cases)
    )


def _half_threads(cases: dict) -> str:
    half, full = cases.get("bf16_half_threads"), cases["bf16"]
    if half is None:
        return ""
    return (
        f" With half the threads on both sides (store.optimizer_threads, bf16_half_threads) our update takes "
        f"{half['ours_ms'] / full['ours_ms']:.2f}x its time on all of them: the cores a daemon leaves to its "
        "trainers cost it that much, its memory bandwidth shared either way."
    )


def _nvme_engines(r: dict) -> str:
    shapes = "; ".join(
        f"{shape}: " + ", ".join(f"{who} {gbps}" for who, gbps in engines.items())
        for shape, engines in r["shapes"].items()
    )
    text = (
        f"GB/s by shape (block x in flight): {shapes}. Not part of `make bench` (`python -m bench.nvme_engines` "
        "with liburing and libaio installed): no engine beats the thread pool by more than the rounds' spread, at "
        "DeepSpeed's own shape (1 MiB x 32) either, so the NVMe tier keeps its threads and depends on neither."
    )
    if "deepspeed" in r.get("engines", []):
        text += (
            " DeepSpeed's own aio handle is among the engines, at the same shapes on the same bytes: it moves them "
            "no faster than the threads. So what `nvme_write` / `nvme_read` lose to it is not the engine but what a "
            "commit (a load) does around the bytes: one shard after another, each ending its requests before the "
            "next starts, and a commit's two fdatasyncs and its header (a load's header and crc32c check), where "
            "the peer submits every shard at once and syncs once. That is what group commit "
            "(ps_daemon/tiers/commit_group.py) answers: `nvme_write` / `nvme_read` now measure a step's shards at once."
        )
        if "threads_locked" in r["shapes"][next(iter(r["shapes"]))]:
            text += " Page-locked memory alone (`threads_locked`, mlock) makes O_DIRECT slower here, not faster."
    return text


def _compress_gpu(r: dict) -> str:
    return (
        f"On {r['notes'].split(' on ')[-1].split(';')[0]}. Variants, GB/s and ratio to a device copy: "
        + ", ".join(f"{k} {v['ours_gbps']} ({v['ratio']})" for k, v in r["methods"].items())
        + f"; one call on 1024 elements {r['launch_overhead_us']} µs (Numba's launch path)."
    )


def _gpu_step(r: dict) -> str:
    steps = r.get("steps_per_s") or {"ours": r["ours"], "torchao": r["peer"]}
    text = f"On {r['device']}, {r['params'] / 1e9:.2f}B parameters: steps/s " + ", ".join(
        f"{who} {v}" for who, v in steps.items()
    )
    if "ratio_vs_torchao_fp32" in r:
        text += f"; against torchao with fp32 state {r['ratio_vs_torchao_fp32']}×"
    idle = r["gpu_idle_fraction"]
    text += ". GPU idle per step: " + ", ".join(f"{who} {_pct(v)}" for who, v in idle.items()) + "."
    if prof := r.get("profile"):
        ours = prof["ours"]
        text += (
            f" Profiled: our step {ours['step_ms']} ms, of which the daemon's optimizer {ours['daemon_optimizer_ms']}"
            " ms; " + ", ".join(f"{who}'s step {v['step_ms']} ms" for who, v in prof.items() if who != "ours") + "."
        )
    return text + (
        " What bounds ours: the daemon's AdamW, memory-bound on the host's cores, over fp32 master, exp_avg and "
        "exp_avg_sq; torchao keeps its CPU copy, and so AdamW's state, in the parameters' dtype, bf16 here: about "
        "half the bytes per step, with bf16 AdamW's rounding (`torchao_fp32`, where measured, is the same "
        "precision as ours)."
    )


def _replication(r: dict) -> str:
    if r["name"] == "replication_overhead":
        b = r["bytes_per_step"]
        return (
            f"Bytes the daemons received per step: {b['r1']} with one holder per shard, {b['r2']} with two. What "
            "it costs: each push goes to both holders and both run AdamW, on the same two cores as the trainer "
            "here; on a cluster the second holder is another node's cores and link."
        )
    if r["name"] == "replication_after_loss":
        m, top, n = r["median_ms"], r["max_ms"], r["steps"]
        return (
            f"Median step before / after a loss: {m['before']} / {m['after']} ms; the slowest step {top['before']} / "
            f"{top['after']} ms ({n['before']} / {n['after']} steps). The lost daemon was asked {r['asked']} times "
            "whether it is back meanwhile, on a thread of its own: a daemon gone for good costs a step nothing "
            "(issue 39 measured a blocking 2 s ask every 5 s before)."
        )
    return (
        f"Each loss, s: {', '.join(str(s) for s in r['stall_s'])}; a step {r['step_ms']} ms. The stall is the "
        "client's dead_peer_seconds by design: a holder that does not answer is retried that long (a daemon "
        "systemd restarts is back within it, and keeps its place) before it is left out. The step that copies a "
        f"replacement's shards back, ms: {', '.join(str(s) for s in r['repair_step_ms'])}."
    )


def _push_in_backward(r: dict) -> str:
    ours, default = r["phase_ms"]["push_in_backward"], r["phase_ms"]["default"]
    speculative = r.get("speculative_steps", {})
    return (
        f"Per phase, ms (push_in_backward / default): forward {ours['forward']} / {default['forward']}, backward "
        f"{ours['backward']} / {default['backward']}, clip {ours['clip']} / {default['clip']}, step {ours['step']} / "
        f"{default['step']}. The daemon computed each shard's step during backward (PushHeader.speculate): "
        f"{speculative.get('adopted', 0)} were adopted by their APPLY and {speculative.get('redone', 0)} computed "
        "again (the clip at 1.0 fired). So the step shrinks, and backward grows by more than the step saves: here "
        "the trainer's backward and the daemon's work on the parts (the part's copy into its accumulator, a copy of "
        "the shard's state into a spare, the update) share the same 2 cores, which torch's threads keep busy in "
        "backward. The overlap pays where backward leaves the host's cores idle (a GPU's backward); it is not "
        "measured there yet."
    )


DETAILS: dict[str, Callable[[dict], str]] = {
    "push_in_backward": _push_in_backward,
    "replication_overhead": _replication,
    "replication_failover": _replication,
    "replication_after_loss": _replication,
    "compress_gpu": _compress_gpu,
    "gpu_step_vs_torchao": _gpu_step,
    "nonfinite_check": _nonfinite_check,
    "daemon_update": _daemon_update,
    "daemon_update_bf16_state": _daemon_update_bf16_state,
    "nvme_engines_write": _nvme_engines,
    "nvme_engines_read": _nvme_engines,
    "optimizer_step": _optimizer_step,
    "transport_pull": _transport,
    "transport_push": _transport,
    "transport_local": _transport_local,
    "nvme_read": _nvme_io,
    "nvme_write": _nvme_io,
    "nvme_train_step": _nvme_train_step,
    "scale_train_step": _scale,
    "fused_decompress_adamw": _fused,
    "compression_convergence": _convergence,
    "staleness_convergence": _convergence,
    "train_step_overhead": _train_step_overhead,
    "train_step_overhead_bf16": _train_step_overhead,
    "audit_overhead": _audit_overhead,
    "pipeline_efficiency": _pipeline,
    "ps_overhead_pp_dp": _ps_overhead,
    "compress_cpu": _compress_cpu,
    "stream_overhead": _stream_overhead,
    "stream_commits": _stream_commits,
    "zero_infinity_small": _zero_infinity,
    "zero_infinity_large": _zero_infinity,
    "zero_infinity_largest": _zero_infinity,
}


def status(results: dict[str, dict]) -> str:
    paragraphs = []
    for name, r in results.items():
        try:
            detail = DETAILS.get(name, lambda _: "")(r)
        except KeyError:  # a result file from before a field existed: say only what it has
            detail = ""
        paragraphs.append(" ".join(x for x in (_head(r), detail, _missing(r)) if x))
    return "\n\n".join(paragraphs)


def update_doc() -> None:
    results = _results()
    chart.render(results, CHART)
    text = DOC.read_text()
    for key, body in (("results", table(results)), ("status", status(results))):
        begin, end = MARKERS[key]
        new = f"{begin}\n{body}\n{end}"
        text = re.sub(f"{re.escape(begin)}.*?{re.escape(end)}", lambda _, new=new: new, text, flags=re.S)
    DOC.write_text(text)


def _timed(name: str, fn: Callable[[], object], seconds: dict[str, float]) -> None:
    """Runs one script, and stores its wall time in the result files it wrote."""
    started = time.perf_counter()
    out = fn()
    seconds[name] = round(time.perf_counter() - started, 1)
    records = out if isinstance(out, list) else [out] if isinstance(out, dict) else []
    for r in records:
        if r and "name" in r:
            path = RESULTS / f"{r['name']}.json"
            data = json.loads(path.read_text())
            data["bench_seconds"] = seconds[name]
            path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"[{name}: {seconds[name]} s]")


def main() -> None:
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    # Compiles DeepSpeed's ops on the first run (minutes), so no benchmark pays for it.
    _timed("deepspeed_ops", deepspeed_ops.main, seconds)
    _timed("optimizer_step", optimizer_step.main, seconds)
    _timed("daemon_update", daemon_update.main, seconds)
    _timed("transport", transport.main, seconds)
    _timed("transport_local", transport_local.main, seconds)
    _timed("train_step_overhead", train_step_overhead.main, seconds)
    _timed("train_step_overhead_bf16", train_step_overhead_bf16.main, seconds)
    _timed("push_in_backward", push_in_backward.main, seconds)
    _timed("audit_overhead", audit_overhead.main, seconds)
    _timed("replication_overhead", replication_overhead.main, seconds)
    _timed("pull_bytes_bf16", pull_bytes_bf16.main, seconds)
    _timed("stream_overhead", stream_overhead.main, seconds)
    _timed("pipeline_efficiency", lambda: pipeline_efficiency.main([]), seconds)
    _timed("ps_overhead_pp_dp", lambda: ps_overhead_pp_dp.main([]), seconds)
    _timed("staleness_convergence", staleness_convergence.main, seconds)
    _timed("compress_cpu", compress_cpu.main, seconds)
    _timed("compress_gpu", compress_gpu.main, seconds)  # says so and records nothing without CUDA
    _timed("gpu_step_vs_torchao", gpu_step_vs_torchao.main, seconds)  # the same, and without torchao
    _timed("fused_decompress_adamw", fused_decompress_adamw.main, seconds)
    _timed("compression_convergence", compression_convergence.main, seconds)
    # DeepSpeed ZeRO-Infinity against the streamed trainer, both from NVMe; records nothing without
    # DeepSpeed. (Its --largest probe is not run here: it takes long.)
    _timed("zero_infinity", zero_infinity.main, seconds)
    _timed("stream_commits", stream_commits.main, seconds)  # a streamed step's commits, synced and not
    if shutil.which("fio"):
        _timed("nvme_io", nvme_io.main, seconds)
        _timed("nvme_train_step", nvme_train_step.main, seconds)
    else:
        print("nvme_io, nvme_train_step: skipped, fio is not installed (apt-get install fio); their results were kept")
    if not QUICK:
        update_doc()
    total = round(time.perf_counter() - started)
    print("seconds per script: " + ", ".join(f"{k} {v}" for k, v in seconds.items()) + f"; total {total}")
    print(f"results in {RESULTS.relative_to(REPO)}/" + ("" if QUICK else f", table in {DOC.relative_to(REPO)}"))


if __name__ == "__main__":
    main()
