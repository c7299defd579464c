"""Compressed all-reduce of gradient buckets over a data-parallel group, with error feedback.

    hook = CompressedAllReduce("onebit")        # or "bf16", "fp16", "topk" (topk_ratio=0.01)
    GradReducer(params, flat_grads, dp_group, microbatches=m, hook=hook)
    hook.enabled = step >= warmup_steps         # uncompressed (plain all_reduce) while False

The shape is DeepSpeed's compressed_allreduce (1-bit Adam): a reduce-scatter done as an
all-to-all of compressed chunks, then an all-gather of compressed chunks.

    c       = bucket + worker_error                       # each rank, the whole bucket
    chunk w = c[w*C : (w+1)*C]                            # W chunks, the last ones short
    send    = [compress(chunk 0), ..., compress(chunk W-1)]   # worker_error <- c - decoded
    recv    = all_to_all(send)                            # rank r: every rank's chunk r
    s       = sum_w decompress(recv[w]) + server_error    # rank r owns chunk r of the sum
    mine    = compress(s)                                 # server_error <- s - decoded
    bucket  = decompress(all_gather(mine))                # every rank: the same bytes

Every rank decompresses the same gathered bytes with the same kernel, so every replica
ends with a bit-identical bucket; a rank's own chunk goes through the same round trip.

Decisions:
* **Sum, not mean.** GradReducer's hook must leave the sum over the group (finish() divides
  by dp x micro-batches), so the server sums the decoded chunks; errors are in sum units.
* **Chunks, no padded values.** C = ceil(n / (W * BLOCK)) * BLOCK, a whole number of the
  kernels' 1024-element blocks (so also of bytes of sign bits): chunk w is c[w*C :
  min((w+1)*C, n)], and the last non-empty chunk may be short or the trailing ones empty
  (when n < (W - 1) * C). Nothing is compressed that is not a gradient (a padded zero
  would dilute the last block's scale). Only the wire pads: every chunk's payload has the
  room of a full chunk, rounded up to 4 bytes, so all_to_all_single and
  all_gather_into_tensor move equal splits. For large buckets the imbalance is below one block per rank; a
  bucket of fewer than W blocks leaves some ranks without a chunk to sum.
* **Traffic** per rank and phase: (W - 1) / W x the payload of the bucket, as a ring
  all-reduce's two phases move (W - 1) / W x 4 bytes per element each. 1-bit: 1/8 byte per
  element plus 4 bytes per block, 1/31 of fp32; bf16 / fp16: 1/2; topk: 8 bytes per kept
  element, 2 x ratio.
* **Memory.** A worker error of the bucket's size (fp32) per bucket, and a server error of
  one chunk: about (1 + 1/W) x the gradients, kept for the run (not in checkpoints).
* **Every collective from the calling thread, in a fixed order.** Collectives on one
  communicator (and, under NCCL, on the communicators of one GPU) must be issued in the
  same order on every rank; a second thread issuing some of them (the pipeline's sends and
  the plain all-reduce come from the caller) could interleave them differently on two
  ranks and hang. So the hook issues phase 1 (encode, all_to_all_single, async) and
  returns a handle; phase 2 (the server's sum and encode, all_gather_into_tensor, async) of
  a bucket is issued by the next hook call or by its handle's wait(), whichever comes
  first, and wait() decodes. The order is then A2A 0, AG 0, A2A 1, AG 1, ... on every rank.
  The network of phase 1 overlaps backward until the next bucket is ready. On a GPU
  nothing blocks the host: kernels and NCCL calls queue on the caller's stream (each
  work's wait() makes it wait for NCCL's). The Numba CPU kernels run with torch's intra-op
  thread count (`_numba_threads`). overlap=False runs both phases inline and returns None.
* **gloo and NCCL.** Both take all_to_all_single and the all-gather into one tensor on uint8
  (gloo in torch 2.13 has both for CPU tensors; checked), so one code path serves both. That
  all-gather is `all_gather_into_tensor` up to torch 2.12 and `all_gather_single` from 2.13,
  which deprecates the old name (`_all_gather`).
* **W = 1** is left alone (the sum over one rank is the bucket, as all_reduce would leave).

Wire, per chunk of L elements (the codecs' payload, padded with zeros to the chunk room):
  onebit: ceil(L/BLOCK) float32 scales, then ceil(L/8) bytes of sign bits (the daemons'
          ONEBIT push encoding);  bf16 / fp16: L 2-byte values;
  topk:   K int32 chunk-local indices, then K float32 values, K = kernels.topk_count(L,
          ratio) (the daemons' TOPK encoding less its K header: both ends know K).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ps_offload import kernels

METHODS = ("none", "bf16", "fp16", "onebit", "topk")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _pad4(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


class _OneBit:
    def __init__(self, kw: dict) -> None:
        self.kw = kw

    def payload_bytes(self, n: int) -> int:
        return _pad4(4 * math.ceil(n / kernels.BLOCK) + math.ceil(n / 8))

    def encode(self, values: torch.Tensor, error: torch.Tensor, out: torch.Tensor) -> None:
        bits, scales = kernels.onebit_compress(values, error, **self.kw)
        at = 4 * scales.numel()
        out[:at].view(torch.float32).copy_(scales)
        out[at : at + bits.numel()].copy_(bits)

    def decode(self, payload: torch.Tensor, n: int, out: torch.Tensor) -> None:
        at = 4 * math.ceil(n / kernels.BLOCK)
        scales = payload[:at].view(torch.float32)
        kernels.onebit_decompress(payload[at : at + math.ceil(n / 8)], scales, n, out=out, **self.kw)


class _Cast:
    def __init__(self, dtype: torch.dtype, kw: dict) -> None:
        self.dtype, self.kw = dtype, kw

    def payload_bytes(self, n: int) -> int:
        return _pad4(2 * n)

    def encode(self, values: torch.Tensor, error: torch.Tensor, out: torch.Tensor) -> None:
        cast = kernels.cast_compress(values, error, dtype=self.dtype, **self.kw)
        out[: 2 * cast.numel()].copy_(cast.view(torch.uint8))

    def decode(self, payload: torch.Tensor, n: int, out: torch.Tensor) -> None:
        kernels.cast_decompress(payload[: 2 * n].view(self.dtype), out=out, **self.kw)


class _TopK:
    def __init__(self, ratio: float, kw: dict) -> None:
        if not (isinstance(ratio, float | int) and 0 < ratio <= 1):
            raise ValueError(f"topk_ratio must be in (0, 1], got {ratio!r}")
        self.ratio, self.kw = float(ratio), kw

    def payload_bytes(self, n: int) -> int:
        return 8 * kernels.topk_count(n, self.ratio)

    def encode(self, values: torch.Tensor, error: torch.Tensor, out: torch.Tensor) -> None:
        indices, kept = kernels.topk_compress(values, error, self.ratio, **self.kw)
        k = indices.numel()
        out[: 4 * k].view(torch.int32).copy_(indices)
        out[4 * k : 8 * k].view(torch.float32).copy_(kept)

    def decode(self, payload: torch.Tensor, n: int, out: torch.Tensor) -> None:
        k = kernels.topk_count(n, self.ratio)
        indices, kept = payload[: 4 * k].view(torch.int32), payload[4 * k : 8 * k].view(torch.float32)
        kernels.topk_decompress(indices, kept, n, out=out, **self.kw)


@contextlib.contextmanager
def _numba_threads(count: int) -> Iterator[None]:
    """Numba's thread count is per thread, and defaults to every core in each process: on a
    node of several ranks the CPU kernels' spinning OpenMP threads then take the other
    ranks' turns (2 ranks on 2 cores: 50-90 ms per bucket instead of 2-5). The hook's work
    uses as many as torch's intra-op pool has (torchrun sets 1 per process), and gives the
    calling thread its own setting back."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(before)


@dataclass
class _BucketState:
    numel: int
    world: int
    chunk: int  # C: elements per chunk, a multiple of BLOCK
    room: int  # payload bytes of one chunk on the wire
    worker_error: torch.Tensor  # [numel]
    server_error: torch.Tensor | None  # [this rank's chunk length]; None when it is empty

    def length(self, w: int) -> int:
        """Elements of chunk w (0 for the empty trailing chunks of a small bucket)."""
        return max(0, min(self.chunk, self.numel - w * self.chunk))


class _Reduction:
    """One bucket's reduction under way: its buffers (allocated at the hook, on the caller's
    stream there) and the works of its two collectives."""

    def __init__(self, bucket: torch.Tensor, group: dist.ProcessGroup, state: _BucketState) -> None:
        self.bucket, self.group, self.state = bucket, group, state
        room, device = state.room, bucket.device
        self.send = torch.zeros(state.world * room, dtype=torch.uint8, device=device)
        self.recv = torch.empty_like(self.send)
        self.mine = torch.zeros(room, dtype=torch.uint8, device=device)
        self.gathered = torch.empty(state.world * room, dtype=torch.uint8, device=device)
        # On an accelerator: the stream the buffers were allocated on (the caller's at the
        # hook), which every later phase's stream is joined back into before they are freed.
        self.stream = None if device.type == "cpu" else torch.accelerator.current_stream(device)
        self.to_all: dist.Work | None = None
        self.gather: dist.Work | None = None

    def joined(self) -> None:
        """Orders the buffers' allocation stream after the current one's work on them."""
        if self.stream is not None:
            self.stream.wait_stream(torch.accelerator.current_stream(self.bucket.device))


class _Handle:
    def __init__(self, hook: CompressedAllReduce, job: _Reduction) -> None:
        self._hook, self._job = hook, job

    def wait(self) -> None:
        self._hook._complete(self._job)


class CompressedAllReduce:
    """A GradReducer hook: leaves in each bucket the sum over the group, compressed both
    ways with error feedback on the workers and on the chunk owners (see the module
    docstring). One instance per flat gradient buffer: a bucket's state is keyed by its
    offset and length in that buffer."""

    def __init__(
        self, method: str, *, topk_ratio: float = 0.01, overlap: bool = True, backend: str | None = None
    ) -> None:
        kw = {} if backend is None else {"backend": backend}
        if method == "onebit":
            self.codec = _OneBit(kw)
        elif method in ("bf16", "fp16"):
            self.codec = _Cast(torch.bfloat16 if method == "bf16" else torch.float16, kw)
        elif method == "topk":
            self.codec = _TopK(topk_ratio, kw)
        else:
            compressed = [m for m in METHODS if m != "none"]
            raise ValueError(f"compression method must be one of {compressed}, got {method!r}")
        self.method = method
        self.enabled = True
        """False: a plain all_reduce (the uncompressed warm-up steps); set between steps."""
        self.overlap = overlap
        self._threads = torch.get_num_threads()
        self._states: dict[tuple[int, int], _BucketState] = {}
        self._pending: list[_Reduction] = []  # hooked, not yet waited for, in hook order

    def __call__(self, bucket: torch.Tensor, group: dist.ProcessGroup) -> object:
        if not self.enabled:
            return dist.all_reduce(bucket, group=group, async_op=True)
        if dist.get_world_size(group) == 1:
            return None
        if bucket.dtype != torch.float32 or bucket.dim() != 1 or not bucket.is_contiguous():
            got = f"{bucket.dtype} of shape {tuple(bucket.shape)}"
            raise ValueError(f"a bucket must be a contiguous 1-D float32 tensor, got {got}")
        self._advance(len(self._pending))  # the earlier buckets' phase 2 first: a fixed order
        job = _Reduction(bucket, group, self._state(bucket, group))
        self._pending.append(job)
        self._scatter(job)
        if self.overlap:
            return _Handle(self, job)
        self._complete(job)
        return None

    def close(self) -> None:
        """Drops the reductions never waited for (their buckets are left as they are)."""
        self._pending.clear()

    def _advance(self, through: int) -> None:
        """Issues phase 2 of the first `through` pending reductions that lack it, in order."""
        for job in self._pending[:through]:
            if job.gather is None:
                self._gather(job)

    def _complete(self, job: _Reduction) -> None:
        """Phase 2 of the reductions up to `job` (in hook order), then `job`'s result."""
        if job not in self._pending:
            return  # completed already (wait() twice)
        self._advance(self._pending.index(job) + 1)
        self._pending.remove(job)
        job.gather.wait()
        state, chunk, room = job.state, job.state.chunk, job.state.room
        with _numba_threads(self._threads):
            for w in range(state.world):
                length = state.length(w)
                if length:
                    self.codec.decode(
                        job.gathered[w * room : (w + 1) * room], length, job.bucket[w * chunk : w * chunk + length]
                    )
        job.joined()

    def _state(self, bucket: torch.Tensor, group: dist.ProcessGroup) -> _BucketState:
        world, rank, n = dist.get_world_size(group), dist.get_rank(group), bucket.numel()
        key = (bucket.storage_offset(), n)
        state = self._states.get(key)
        if state is None:
            chunk = math.ceil(n / (world * kernels.BLOCK)) * kernels.BLOCK
            mine = max(0, min(chunk, n - rank * chunk))
            state = _BucketState(
                numel=n, world=world, chunk=chunk, room=self.codec.payload_bytes(chunk),
                worker_error=torch.zeros(n, dtype=torch.float32, device=bucket.device),
                server_error=torch.zeros(mine, dtype=torch.float32, device=bucket.device) if mine else None,
            )  # fmt: skip
            self._states[key] = state
        elif state.world != world:
            raise ValueError(f"bucket {key} was reduced over {state.world} ranks before, now over {world}")
        return state

    def _scatter(self, job: _Reduction) -> None:
        """Phase 1: every rank's chunk w, compressed, to rank w (a reduce-scatter's traffic)."""
        state, bucket, chunk, room = job.state, job.bucket, job.state.chunk, job.state.room
        with _numba_threads(self._threads):
            for w in range(state.world):
                length = state.length(w)
                if length:
                    part = slice(w * chunk, w * chunk + length)
                    self.codec.encode(bucket[part], state.worker_error[part], job.send[w * room : (w + 1) * room])
        job.to_all = dist.all_to_all_single(job.recv, job.send, group=job.group, async_op=True)

    def _gather(self, job: _Reduction) -> None:
        """Phase 2: this rank's chunk of the sum, plus its error, compressed again (the
        server), and every chunk owner's result to every rank (an all-gather's traffic)."""
        state, room = job.state, job.state.room
        job.to_all.wait()
        length = state.length(dist.get_rank(job.group))
        if length:
            total = torch.zeros(length, dtype=torch.float32, device=job.bucket.device)
            decoded = torch.empty_like(total)
            with _numba_threads(self._threads):
                for w in range(state.world):  # a fixed order: the same sum on every run
                    self.codec.decode(job.recv[w * room : (w + 1) * room], length, decoded)
                    total += decoded
                self.codec.encode(total, state.server_error, job.mine)
        job.gather = _all_gather(job.gathered, job.mine, group=job.group, async_op=True)
        job.joined()
