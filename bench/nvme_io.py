"""nvme_write, nvme_read: the NVMe tier's swap-out (commit: bytes, fdatasync, header,
fdatasync, per shard) and swap-in (load: header, bytes, crc32c check) throughput, vs fio
sequential O_DIRECT write (with a final fsync) and read of the same total bytes in the same
directory. O_DIRECT on both sides: the page cache is bypassed, so this measures the disk.

Ratio = our GB/s over fio's; target >= 0.9 each. Needs fio (`apt-get install fio`; `make
bench` installs it when it can).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.common import REPO, median, record, timed
from ps_offload.daemon.optim import AdamWConfig
from ps_offload.daemon.store import ModelSpec, ParamSpec, allocate_arena, arena_numel
from ps_offload.daemon.tiers.nvme import DirectIO, NvmeFiles

SHARDS = 16
SHARD_NUMEL = 5 << 20  # AdamW: arena of 3 x 20 MiB + stagger = 60 MiB; 16 shards = 960 MiB
REPS = 3


def _fio(directory: Path, rw: str, nbytes: int) -> float:
    """fio's bandwidth in GB/s for a sequential O_DIRECT job of nbytes."""
    out = subprocess.run(
        [
            "fio", "--name=peer", f"--filename={directory / 'fio.dat'}", f"--rw={rw}", "--bs=8M",
            f"--size={nbytes}", "--direct=1", "--ioengine=libaio", "--iodepth=8", "--numjobs=1",
            "--end_fsync=1", "--output-format=json",
        ],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    job = json.loads(out)["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return side["bw_bytes"] / 1e9


def main() -> list[dict]:
    if shutil.which("fio") is None:
        raise SystemExit("nvme_io: fio is not installed (apt-get install fio); it is the peer this bench needs")
    with tempfile.TemporaryDirectory(prefix="ps-bench-nvme-", dir=REPO) as tmp:
        directory = Path(tmp)
        files = NvmeFiles(directory / "nvme", io=DirectIO(threads=4, block_bytes=8 << 20), fsync=True)
        nbytes = arena_numel(SHARD_NUMEL, 2) * 4
        spec = ModelSpec("bench", (ParamSpec("w", (SHARDS * SHARD_NUMEL,)),), AdamWConfig(), SHARD_NUMEL * 4, ("d",))
        files.create_model(spec, 0, {i: nbytes for i in range(SHARDS)})
        arenas = [allocate_arena(nbytes) for _ in range(SHARDS)]
        for tensor, _ in arenas:
            tensor.normal_()
        total = sum(len(view) for _, view in arenas)

        def write_all() -> None:
            for i, (_, view) in enumerate(arenas):
                files.commit("bench", i, view, version=1, initialized=True, numel=SHARD_NUMEL)

        def read_all() -> None:
            for i, (_, view) in enumerate(arenas):
                assert files.load("bench", i, view) is not None

        # Both sides then write into space that exists already (ours is preallocated at
        # registration): fio's first pass lays its file out and is not counted.
        _fio(directory, "write", total)
        write_all()
        ours_w, ours_r, fio_w, fio_r = [], [], [], []
        for _ in range(REPS):  # interleaved with fio, write then read
            ours_w.append(total / timed(write_all) / 1e9)
            fio_w.append(_fio(directory, "write", total))
            ours_r.append(total / timed(read_all) / 1e9)
            fio_r.append(_fio(directory, "read", total))
        files.close()
    notes = (
        f"{total >> 20} MiB in {SHARDS} shard slots, 4 I/O threads x 8 MiB blocks, fdatasync twice per shard; "
        "peer: fio libaio iodepth 8, bs 8M, O_DIRECT, end_fsync; median of 3 interleaved runs"
    )
    return [
        record("nvme_write", ours=median(ours_w), peer=median(fio_w), unit="GB/s", target=0.9,
               higher_is_better=True, notes=notes),
        record("nvme_read", ours=median(ours_r), peer=median(fio_r), unit="GB/s", target=0.9,
               higher_is_better=True, notes=notes),
    ]  # fmt: skip


if __name__ == "__main__":
    main()
