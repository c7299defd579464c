"""nvme_write, nvme_read: the NVMe tier's swap-out (commit: bytes, fdatasync, header,
fdatasync, per shard) and swap-in (load: header, bytes, crc32c check) throughput, against two
peers moving the same bytes in a file of the same size in the same directory:

* fio, sequential O_DIRECT write (end_fsync) and read, libaio, iodepth 8, 8 MiB blocks;
* DeepSpeed's async I/O handle (`deepspeed.ops.op_builder.AsyncIOBuilder`, what ZeRO-Infinity
  swaps optimizer state with): 1 MiB blocks, queue depth 32, one buffer per shard in its own
  page-locked memory, every shard submitted at once then `wait()`; its writes end with one
  fdatasync, as fio's end_fsync.

O_DIRECT everywhere: the page cache is bypassed, so this measures the disk (and, on a VM, its
host's cache). The three run interleaved, ABC CBA, after a warm-up that writes every slot of
each file once (so no one writes into unwritten extents); each figure is the median of the
per-round ratios, ours over the faster peer of that round, target >= 0.9. The ratios to each
peer alone, and their spread, are in the result file. Needs fio (`make bench` installs it);
DeepSpeed is the `bench` extra, and a peer that is missing is recorded as missing.

`ours` commits (loads) a step's shards at once, as a daemon does when a step's pushes arrive
from its trainers' streams and ranks: the commits queue and are written as groups, every
arena of a group in flight together and two fdatasyncs per group
(ps_daemon/tiers/commit_group.py). `one_at_a_time` commits (loads) one shard after another,
as a single stream of pushes makes the daemon do. Both are timed in the same rounds; the
headline is `ours`; the groups it wrote, and `one_at_a_time`'s ratio, are in the result file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import REPO, interleaved_many, median, quick, record, spread
from ps_offload.daemon.model.spec import ModelSpec, ParamSpec, spec_to_dict
from ps_offload.daemon.store.shard import allocate_arena, arena_numel
from ps_offload.daemon.tiers.nvme import PAGE, DirectIO, NvmeFiles
from ps_offload.optimizers import AdamW

SHARDS = quick(16, 4)
SHARD_NUMEL = 5 << 20  # AdamW: arena of 3 x 20 MiB + stagger = 60 MiB; 16 shards = 960 MiB
ROUNDS = quick(10, 2)  # ABC CBA: 10 rounds = 5 full ABC CBA cycles (a noisy disk: the median steadies)
IO_THREADS, IO_READ_THREADS, IO_BLOCK = 4, 8, 8 << 20  # ours: DirectIO(...), as the daemon's defaults
COMMITTERS = SHARDS  # ours: a step's shards committed (or loaded) at once


FIO_BLOCK = 8 << 20


def round_up(n: int) -> int:
    return -(-n // FIO_BLOCK) * FIO_BLOCK


def fio_seconds(path: Path, rw: str, *, io_bytes: int, file_bytes: int, read_percent: int = 50) -> float:
    """Seconds fio takes for a sequential O_DIRECT job moving `io_bytes` within a file of
    `file_bytes` (its job runtime, with the end fsync; not its process start). rw: "write",
    "read" or "rw" (a `read_percent` mix). fio moves whole 8 MiB blocks: both sizes are rounded
    up to one, and the time is scaled back to `io_bytes`."""
    out = subprocess.run(
        [
            "fio", "--name=peer", f"--filename={path}", f"--rw={rw}", f"--bs={FIO_BLOCK}",
            f"--size={round_up(file_bytes)}", f"--io_size={round_up(io_bytes)}", "--direct=1", "--ioengine=libaio",
            "--iodepth=8", "--numjobs=1", "--end_fsync=1", f"--rwmixread={read_percent}", "--output-format=json",
        ],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    job = json.loads(out)["jobs"][0]
    moved = job["read"]["io_bytes"] + job["write"]["io_bytes"]
    if moved < io_bytes:
        raise RuntimeError(f"fio moved {moved} bytes, asked for {io_bytes}")
    return job["job_runtime"] / 1000 * io_bytes / moved


def _fio(directory: Path, rw: str, nbytes: int) -> float:
    """fio's GB/s for a sequential O_DIRECT job of nbytes in a file of nbytes."""
    return nbytes / fio_seconds(directory / "fio.dat", rw, io_bytes=nbytes, file_bytes=nbytes) / 1e9


def deepspeed_missing() -> str | None:
    """Why DeepSpeed's async I/O cannot run here, or None."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return "DeepSpeed is not installed (the `bench` extra: make bench installs it)"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return "DeepSpeed's async_io op cannot build here (it needs libaio-dev)"
    return None


class DeepSpeedAIO:
    """DeepSpeed's aio handle writing and reading one buffer per shard at our slots' offsets
    in a file of our arena file's size."""

    def __init__(self, path: Path, *, file_bytes: int, offsets: list[int], nbytes: int) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        # The 0.19 signature: block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism.
        self.handle = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 32, False, True, 1)
        self.path, self.offsets = str(path), offsets
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, file_bytes)  # as ours: preallocated at registration
        os.close(fd)
        example = torch.empty(0, dtype=torch.uint8)
        self.buffers = [self.handle.new_cpu_locked_tensor(nbytes, example) for _ in offsets]
        for b in self.buffers:
            b.random_(0, 256)

    def write(self) -> None:
        for buffer, offset in zip(self.buffers, self.offsets, strict=True):
            if self.handle.async_pwrite(buffer, self.path, offset) != 0:
                raise RuntimeError("deepspeed async_pwrite failed")
        if self.handle.wait() != len(self.buffers):
            raise RuntimeError("deepspeed aio: not every write completed")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def read(self) -> None:
        for buffer, offset in zip(self.buffers, self.offsets, strict=True):
            if self.handle.async_pread(buffer, self.path, offset) != 0:
                raise RuntimeError("deepspeed async_pread failed")
        if self.handle.wait() != len(self.buffers):
            raise RuntimeError("deepspeed aio: not every read completed")

    def close(self) -> None:
        for b in self.buffers:
            self.handle.free_cpu_locked_tensor(b)
        self.buffers = []


def main() -> list[dict]:
    if shutil.which("fio") is None:
        raise SystemExit("nvme_io: fio is not installed (apt-get install fio); it is the peer this bench needs")
    ds_missing = deepspeed_missing()
    if ds_missing:
        print(f"nvme_io: {ds_missing}; its figures are recorded as missing")
    with tempfile.TemporaryDirectory(prefix="ps-bench-nvme-", dir=REPO) as tmp:
        directory = Path(tmp)
        io = DirectIO(threads=IO_THREADS, block_bytes=IO_BLOCK, read_threads=IO_READ_THREADS)
        files = NvmeFiles(directory / "nvme", io=io, fsync=True)
        nbytes = arena_numel(SHARD_NUMEL, 2) * 4
        spec = ModelSpec("bench", (ParamSpec("w", (SHARDS * SHARD_NUMEL,)),), AdamW(), SHARD_NUMEL * 4, ("d",))
        layout = files.create_model(spec_to_dict(spec), 0, {i: nbytes for i in range(SHARDS)})
        arenas = [allocate_arena(nbytes) for _ in range(SHARDS)]
        for tensor, _ in arenas:
            tensor.normal_()
        total = sum(len(view) for _, view in arenas)
        file_bytes = layout.size  # every peer's file is as large as our arena file (slots + spares)
        slot_offsets = [slot * layout.slot_bytes + PAGE for slot in range(SHARDS)]

        def one_at_a_time_write() -> None:
            for i, (_, view) in enumerate(arenas):
                files.commit("bench", i, view, version=1, initialized=True, numel=SHARD_NUMEL)

        def one_at_a_time_read() -> None:
            for i, (_, view) in enumerate(arenas):
                assert files.load("bench", i, view) is not None

        # As the daemon commits and loads when a step's pushes and prefetches run at once:
        # COMMITTERS shards at a time, written in groups (ps_daemon/tiers/commit_group.py).
        together = ThreadPoolExecutor(max_workers=COMMITTERS)
        grouped = {"groups": 0, "commits": 0}

        def ours_write() -> None:
            groups = files.files["bench"].groups
            before = groups.groups, groups.commits
            commit = lambda i: files.commit("bench", i, arenas[i][1], version=1, initialized=True, numel=SHARD_NUMEL)  # noqa: E731
            list(together.map(commit, range(SHARDS)))
            grouped["groups"] += groups.groups - before[0]
            grouped["commits"] += groups.commits - before[1]

        def ours_read() -> None:
            assert all(together.map(lambda i: files.load("bench", i, arenas[i][1]) is not None, range(SHARDS)))

        # A diagnostic, not a contender: the same DirectIO moving the same shards' bytes to the
        # same offsets of a file of its own, shard after shard, without a commit's header, its
        # two fdatasyncs per shard and a load's crc32c check (one fdatasync after all writes, as
        # the DeepSpeed peer's). What the commit protocol costs = ours against this.
        raw_path = directory / "raw.dat"
        with open(raw_path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, file_bytes)
        raw_io = DirectIO(threads=IO_THREADS, block_bytes=IO_BLOCK, read_threads=IO_READ_THREADS)
        raw_fd = os.open(raw_path, os.O_RDWR | os.O_DIRECT)

        def bytes_only_write() -> None:
            for (_, view), offset in zip(arenas, slot_offsets, strict=True):
                raw_io.write(raw_fd, view, offset)
            os.fdatasync(raw_fd)

        def bytes_only_read() -> None:
            for (_, view), offset in zip(arenas, slot_offsets, strict=True):
                raw_io.read(raw_fd, view, offset)

        fio_path = directory / "fio.dat"
        writes = {"ours": ours_write, "one_at_a_time": one_at_a_time_write, "bytes_only": bytes_only_write,
                  "fio": lambda: fio_seconds(fio_path, "write", io_bytes=total, file_bytes=file_bytes)}  # fmt: skip
        reads = {"ours": ours_read, "one_at_a_time": one_at_a_time_read, "bytes_only": bytes_only_read,
                 "fio": lambda: fio_seconds(fio_path, "read", io_bytes=total, file_bytes=file_bytes)}  # fmt: skip
        ds = None
        if not ds_missing:
            ds = DeepSpeedAIO(directory / "deepspeed.dat", file_bytes=file_bytes, offsets=slot_offsets, nbytes=nbytes)
            writes["deepspeed"], reads["deepspeed"] = ds.write, ds.read

        # Warm-up, untimed: fio lays its whole file out; ours commits twice, which with the
        # spare slots taken in turn writes every slot; DeepSpeed writes its slots once.
        fio_seconds(fio_path, "write", io_bytes=file_bytes, file_bytes=file_bytes)
        one_at_a_time_write()
        one_at_a_time_write()
        bytes_only_write()
        grouped.update(groups=0, commits=0)
        write_t = interleaved_many(writes, reps=ROUNDS, warmup=1)
        read_t = interleaved_many(reads, reps=ROUNDS, warmup=1)
        together.shutdown()
        flushes = files.files["bench"].flushes
        # What the flushes cost: two per commit one after another, against such a commit's
        # whole time; and how the step's commits were grouped (two flushes per group).
        flush_ms = flushes.seconds / max(flushes.flushes, 1) * 1e3
        commit_ms = median(write_t["one_at_a_time"]) / SHARDS * 1e3
        shared = {
            "flushes": flushes.flushes,
            "sync_calls": flushes.calls,
            "flush_ms": round(flush_ms, 3),
            "commit_ms": round(commit_ms, 2),
            "flush_share": round(2 * flush_ms / commit_ms, 4),
            "groups": grouped["groups"],
            "commits_grouped": grouped["commits"],
            "commits_per_group": round(grouped["commits"] / max(grouped["groups"], 1), 2),
        }
        if ds is not None:
            ds.close()
        files.close()
        os.close(raw_fd)
        raw_io.close()

    peers = ["fio"] + ([] if ds_missing else ["deepspeed"])
    results = []
    for name, t in (("nvme_write", write_t), ("nvme_read", read_t)):
        gbps = {who: total / median(ts) / 1e9 for who, ts in t.items()}
        # Throughput ratios per round: a peer's seconds over ours.
        vs = {who: [p / o for o, p in zip(t["ours"], t[who], strict=True)] for who in peers}
        best = [min(t[who][r] for who in peers) / t["ours"][r] for r in range(ROUNDS)]
        best_one = [min(t[who][r] for who in peers) / t["one_at_a_time"][r] for r in range(ROUNDS)]
        faster = max(peers, key=lambda who: gbps[who])
        results.append(
            record(
                name,
                ours=gbps["ours"],
                peer=gbps[faster],
                ratio=median(best),
                unit="GB/s",
                target=0.9,
                higher_is_better=True,
                notes=f"{total >> 20} MiB in {SHARDS} shard slots of a {file_bytes >> 20} MiB arena file, "
                f"{IO_THREADS} writer and {IO_READ_THREADS} reader threads x {IO_BLOCK >> 20} MiB blocks, all "
                f"{SHARDS} shards committed (loaded) at once, in groups, two fdatasyncs per group; peers in files of "
                "the same size: fio libaio iodepth 8, bs 8M, end_fsync; DeepSpeed aio handle (block 1 MiB, queue "
                "depth 32, page-locked buffers, one fdatasync after writes)"
                + (f" [DeepSpeed missing: {ds_missing}]" if ds_missing else "")
                + f"; {ROUNDS} rounds ABC CBA; ratio = median over rounds of ours / the faster peer of that round; "
                f"peer column = the faster peer's median ({faster})",
                extra={
                    "bytes": total,
                    "file_bytes": file_bytes,
                    "gbps": {who: round(v, 3) for who, v in gbps.items()},
                    "ratio_spread": spread(best),
                    **{f"ratio_vs_{who}": round(median(vs[who]), 3) for who in peers},
                    **{f"ratio_vs_{who}_spread": spread(vs[who]) for who in peers},
                    "peer_missing": {"deepspeed": ds_missing} if ds_missing else {},
                    # One shard after another (a single stream of pushes): the same peers and rounds.
                    "ratio_one_at_a_time": round(median(best_one), 3),
                    "ratio_one_at_a_time_spread": spread(best_one),
                    "committers": COMMITTERS,
                    "flushes_shared": shared,
                    # The same bytes through the same DirectIO without the commit protocol (above).
                    "ratio_to_bytes_only": round(
                        median([b / o for o, b in zip(t["ours"], t["bytes_only"], strict=True)]), 3
                    ),
                    "bytes_only_vs_faster_peer": round(
                        median([min(t[who][r] for who in peers) / t["bytes_only"][r] for r in range(ROUNDS)]), 3
                    ),
                },
            )
        )
    return results


if __name__ == "__main__":
    main()
