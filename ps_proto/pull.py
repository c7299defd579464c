"""Pull-stream reassembly: a ParameterServer.Pull answer (PullChunks, the first carrying the
ShardHeader, then the shard's bytes in order) written back into one buffer.

Trainers and ps-admin both read Pull streams; the checks live here once, so neither can accept
a stream the other refuses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ps_offload.proto import ps_pb2
from ps_offload.proto.codec import Chunk

ELEMENT_BYTES = {ps_pb2.DTYPE_UNSPECIFIED: 4, ps_pb2.FLOAT32: 4, ps_pb2.BFLOAT16: 2, ps_pb2.FLOAT16: 2}
"""Bytes per element of a Pull by PullRequest.dtype (unset: fp32, as the daemon stores it)."""


def element_bytes(dtype: int) -> int:
    try:
        return ELEMENT_BYTES[dtype]
    except KeyError:
        raise ValueError(f"no such DType {dtype}") from None


@dataclass(frozen=True)
class Pull:
    """One shard's pull as it crosses the wire: the PullRequest built once by whoever decides the
    pull (the trainer's client) and read unchanged by every transport (gRPC's Pull stream, the
    data plane, the local path), as `Push` is for pushes."""

    request: ps_pb2.PullRequest

    @classmethod
    def of(
        cls, model: str, shard_id: int, *, min_version: int, tensor: int = ps_pb2.MASTER, dtype: int = ps_pb2.FLOAT32
    ) -> Pull:
        """Shard `shard_id`'s `tensor` (master values unless told otherwise) at `min_version` or
        later, in `dtype` (FLOAT32: as stored; BFLOAT16 / FLOAT16, master only: rounded as torch's
        Tensor.to rounds)."""
        return cls(ps_pb2.PullRequest(model=model, shard_id=shard_id, min_version=min_version, tensor=tensor,
                                      dtype=dtype))  # fmt: skip

    @property
    def shard_id(self) -> int:
        return self.request.shard_id

    @property
    def dtype(self) -> int:
        return self.request.dtype

    def describe(self) -> str:
        """For messages: "pull of shard 3 EXP_AVG (version >= 5)"."""
        tensor = self.request.tensor
        what = "" if tensor == ps_pb2.MASTER else f" {ps_pb2.ShardTensor.Name(tensor)}"
        return f"pull of shard {self.shard_id}{what} (version >= {self.request.min_version})"


class PullStreamError(ValueError):
    """A Pull stream that does not fill its destination exactly: the two ends disagree on the
    plan, or the stream was cut short."""


def read_pull_stream(
    chunks: Iterable[Chunk[ps_pb2.ShardHeader]],
    out: memoryview | bytearray,
    *,
    what: str,
    dtype: int = ps_pb2.FLOAT32,
) -> int:
    """Copies a shard's Pull stream into `out` (exactly the shard's bytes in `dtype`, the
    PullRequest's) and returns the version its header names. `what` names the shard in
    errors ("shard 3 from daemon ...").

    Invariants checked: the header's element count is `out`'s; no more bytes arrive than `out`
    holds; the stream ends with `out` full and a header seen. A chunk that breaks one raises
    PullStreamError at once, before anything lands past `out`'s end. gRPC errors of the
    stream pass through unchanged, for the caller's retry policy to judge.
    """
    view = memoryview(out).cast("B")
    size, width = view.nbytes, element_bytes(dtype)
    version, received = -1, 0
    for chunk in chunks:
        if chunk.header is not None:
            check_pull_header(chunk.header, size, dtype, what)
            version = chunk.header.version
        n = len(chunk.data)
        if received + n > size:
            raise PullStreamError(f"{what} came with more than its {size // width} elements")
        view[received : received + n] = chunk.data
        received += n
    if received != size or version < 0:
        raise PullStreamError(f"{what} ended after {received} of {size} bytes")
    return version


def check_pull_header(header: ps_pb2.ShardHeader, size: int, dtype: int, what: str) -> None:
    """The daemon's answer to a pull of `size` bytes in `dtype` names as many elements, in
    that dtype (a daemon that ignored PullRequest.dtype would send fp32)."""
    width = element_bytes(dtype)
    sent = header.dtype or ps_pb2.FLOAT32
    if sent != (dtype or ps_pb2.FLOAT32):
        raise PullStreamError(
            f"{what} came as {ps_pb2.DType.Name(sent)}, {ps_pb2.DType.Name(dtype or ps_pb2.FLOAT32)} was asked for: "
            "is the daemon older than this trainer?"
        )
    if header.numel * width != size:
        raise PullStreamError(
            f"{what} came with {header.numel} elements, the plan says {size // width}: "
            "the two ends disagree on the plan"
        )
