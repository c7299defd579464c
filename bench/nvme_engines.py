"""`nvme_engines`: does an asynchronous I/O engine from Python beat the NVMe tier's thread pool?

Issue #25 asked: if a maintained library gives Linux async I/O from Python and beats threads
here, use it. Three engines move the same 960 MiB, O_DIRECT, in the same file in the repository
directory (the disk the other NVMe figures use), with the same block size and the same number
of requests in flight, in ABC CBA rounds:

* threads: os.pwritev/preadv in a thread pool (the GIL is released), what ps_daemon/tiers/direct_io.py does;
* io_uring through `liburing` (PyPI; its 2026 wheels die with SIGILL on this AVX2 CPU, so build
  it: `pip install 'liburing<2025' --no-binary liburing`);
* kernel AIO through `libaio` (PyPI, python-libaio, ctypes).

A write is followed by one fdatasync, as a commit's. Figures: GB/s per engine, and the ratio
threads / the faster async engine (write and read). Not part of `make bench`: the two
libraries are not dependencies (the answer is what to depend on). Run it with both installed:
`.venv/bin/python -m bench.nvme_engines`.
"""

from __future__ import annotations

import functools
import mmap
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from bench.common import REPO, interleaved_many, quick, record, spread

TOTAL = quick(960 << 20, 64 << 20)
SHAPES = [(1 << 20, 32), (8 << 20, 4), (8 << 20, 8)]  # (block, in flight): DeepSpeed's, ours, ours deeper
REPS = quick(4, 2)


def _threads(path: str, view: memoryview, block: int, depth: int, write: bool) -> None:
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:

        def one(offset: int) -> None:
            part = view[offset : offset + block]
            os.pwritev(fd, [part], offset) if write else os.preadv(fd, [part], offset)

        with ThreadPoolExecutor(depth) as pool:
            list(pool.map(one, range(0, len(view), block)))
        if write:
            os.fdatasync(fd)
    finally:
        os.close(fd)


def _uring(path: str, view: memoryview, block: int, depth: int, write: bool) -> None:
    import liburing

    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    ring, cqe = liburing.io_uring(), liburing.io_uring_cqe()
    liburing.io_uring_queue_init(depth, ring, 0)
    prep = liburing.io_uring_prep_write if write else liburing.io_uring_prep_read
    try:
        offsets = iter(range(0, len(view), block))
        in_flight = 0
        while True:
            for offset in offsets if in_flight < depth else ():
                prep(liburing.io_uring_get_sqe(ring), fd, view[offset : offset + block], block, offset)
                in_flight += 1
                if in_flight == depth:
                    break
            if not in_flight:
                break
            liburing.io_uring_submit(ring)
            liburing.io_uring_wait_cqe(ring, cqe)
            if cqe.res != block:
                raise OSError(-cqe.res if cqe.res < 0 else 5, "io_uring: short or failed transfer")
            liburing.io_uring_cqe_seen(ring, cqe)
            in_flight -= 1
        if write:
            os.fdatasync(fd)
    finally:
        liburing.io_uring_queue_exit(ring)
        os.close(fd)


def _aio(path: str, view: memoryview, block: int, depth: int, write: bool) -> None:
    import libaio

    mode = libaio.AIOBLOCK_MODE_WRITE if write else libaio.AIOBLOCK_MODE_READ
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    file = os.fdopen(fd, "r+b", buffering=0)
    context = libaio.AIOContext(depth)
    try:
        offsets = list(range(0, len(view), block))
        done = submitted = 0
        while done < len(offsets):
            blocks = [
                libaio.AIOBlock(mode, file, [view[o : o + block]], o)
                for o in offsets[submitted : submitted + depth - (submitted - done)]
            ]
            if blocks:
                context.submit(blocks)
                submitted += len(blocks)
            try:
                events = context.getEvents(min_nr=1)
            except InterruptedError:  # io_getevents is not restarted after a signal
                continue
            for _block, result, _result2 in events:
                if result != block:
                    raise OSError(5, f"libaio: transfer of {result} bytes, not {block}")
            done += len(events)
        if write:
            os.fdatasync(fd)
    finally:
        context.close()
        file.close()


@functools.cache
def _deepspeed_handle(block: int, depth: int):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    # 0.19: block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism (as nvme_io)
    return AsyncIOBuilder().load(verbose=False).aio_handle(block, depth, False, True, 1)


_DEEPSPEED_BUFFERS: dict[int, object] = {}


def _deepspeed(path: str, view: memoryview, block: int, depth: int, write: bool) -> None:
    """DeepSpeed's aio handle at the same block size and queue depth, from its own page-locked
    buffer holding the same bytes (ZeRO-Infinity's swapper), then one fdatasync."""
    import torch

    handle = _deepspeed_handle(block, depth)
    key = id(view)
    if key not in _DEEPSPEED_BUFFERS:
        locked = handle.new_cpu_locked_tensor(len(view), torch.empty(0, dtype=torch.uint8))
        locked.copy_(torch.frombuffer(view, dtype=torch.uint8))
        _DEEPSPEED_BUFFERS[key] = locked
    buffer = _DEEPSPEED_BUFFERS[key]
    submit = handle.async_pwrite if write else handle.async_pread
    if submit(buffer, path, 0) != 0 or handle.wait() != 1:
        raise OSError(5, "deepspeed aio: the transfer failed")
    if write:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def _locked(view: memoryview) -> memoryview:
    """The same bytes in page-locked memory (mlock), as DeepSpeed's buffers are: does locking
    alone make O_DIRECT faster?"""
    import ctypes

    region = mmap.mmap(-1, len(view))
    locked = memoryview(region)
    locked[:] = view
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if ctypes.CDLL(None, use_errno=True).mlock(ctypes.c_void_p(address), ctypes.c_size_t(len(view))) != 0:
        raise OSError(ctypes.get_errno(), "mlock of the benchmark buffer failed (RLIMIT_MEMLOCK?)")
    return locked


# (engine, the Python module it needs or None)
ENGINES = {
    "threads": (_threads, None),
    "threads_locked": (_threads, None),  # the same, from page-locked memory
    "io_uring": (_uring, "liburing"),
    "libaio": (_aio, "libaio"),
    "deepspeed": (_deepspeed, "deepspeed"),
}


def main() -> list[dict]:
    present = {name: fn for name, (fn, module) in ENGINES.items() if module is None or _importable(module)}
    others = [name for name in present if not name.startswith("threads")]
    missing = sorted(set(ENGINES) - set(present))
    if not others:
        print("nvme_engines: skipped, none of liburing, libaio, deepspeed is installed (see bench/nvme_engines.py)")
        return []
    region = mmap.mmap(-1, TOTAL)
    view = memoryview(region)
    view[:] = os.urandom(1 << 20) * (TOTAL >> 20)
    locked = _locked(view)
    shapes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ps-bench-engines-", dir=REPO) as tmp:
        path = os.path.join(tmp, "file")
        with open(path, "wb") as f:  # written once before timing, as every NVMe figure's file
            f.write(view)
            os.fsync(f.fileno())
        for block, depth in SHAPES:
            for write in (True, False):
                runs = {
                    name: functools.partial(fn, path, locked if name == "threads_locked" else view, block, depth, write)
                    for name, fn in present.items()
                }
                times = interleaved_many(runs, reps=REPS)
                gbps = {name: [TOTAL / t / 1e9 for t in ts] for name, ts in times.items()}
                key = f"{'write' if write else 'read'} {block >> 20} MiB x {depth}"
                shapes[key] = {
                    "gbps": {name: round(statistics.median(v), 3) for name, v in gbps.items()},
                    # per round: our threads over the fastest other engine of that round
                    "ratios": [
                        gbps["threads"][i] / max(gbps[name][i] for name in others) for i in range(len(gbps["threads"]))
                    ],
                }
                print(key, shapes[key]["gbps"])
    records = []
    for kind in ("write", "read"):
        ratios = [r for key, s in shapes.items() if key.startswith(kind) for r in s["ratios"]]
        ours = statistics.median([s["gbps"]["threads"] for key, s in shapes.items() if key.startswith(kind)])
        peer = statistics.median(
            [max(s["gbps"][name] for name in others) for key, s in shapes.items() if key.startswith(kind)]
        )
        records.append(
            record(
                f"nvme_engines_{kind}",
                ours=ours,
                peer=peer,
                unit="GB/s",
                target=0.95,
                higher_is_better=True,
                ratio=statistics.median(ratios),
                notes=(
                    f"the NVMe tier's thread pool against the fastest of {', '.join(others)}, "
                    f"{TOTAL >> 20} MiB O_DIRECT {kind}s of the same blocks with the same number in flight, "
                    "over three shapes (1 MiB x 32, 8 MiB x 4, 8 MiB x 8); ABC CBA rounds; ratio = median of the "
                    "per-round ratios"
                ),
                extra={
                    "engines": list(present),
                    "engines_missing": missing,
                    "ratio_spread": spread(ratios),
                    "shapes": {k: s["gbps"] for k, s in shapes.items() if k.startswith(kind)},
                },
            )
        )
    return records


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
