"""Pull-stream reassembly: a ParameterServer.Pull answer (PullChunks, the first carrying the
ShardHeader, then the shard's bytes in order) written back into one buffer.

Trainers and ps-admin both read Pull streams; the checks live here once, so neither can accept
a stream the other refuses.
"""

from __future__ import annotations

from collections.abc import Iterable

from ps_offload.proto import ps_pb2
from ps_offload.proto.codec import Chunk

ELEMENT_BYTES = 4
"""Every tensor a Pull streams (master values, AdamW's moments) is fp32."""


class PullStreamError(ValueError):
    """A Pull stream that does not fill its destination exactly: the two ends disagree on the
    plan, or the stream was cut short."""


def read_pull_stream(chunks: Iterable[Chunk[ps_pb2.ShardHeader]], out: memoryview | bytearray, *, what: str) -> int:
    """Copies a shard's Pull stream into `out` (exactly the shard's bytes) and returns the
    version its header names. `what` names the shard in errors ("shard 3 from daemon ...").

    Invariants checked: the header's element count is `out`'s; no more bytes arrive than `out`
    holds; the stream ends with `out` full and a header seen. A chunk that breaks one raises
    PullStreamError at once, before anything lands past `out`'s end. gRPC errors of the
    stream pass through unchanged, for the caller's retry policy to judge.
    """
    view = memoryview(out).cast("B")
    size = view.nbytes
    version, received = -1, 0
    for chunk in chunks:
        if chunk.header is not None:
            if chunk.header.numel * ELEMENT_BYTES != size:
                raise PullStreamError(
                    f"{what} came with {chunk.header.numel} elements, the plan says {size // ELEMENT_BYTES}: "
                    "the two ends disagree on the plan"
                )
            version = chunk.header.version
        n = len(chunk.data)
        if received + n > size:
            raise PullStreamError(f"{what} came with more than its {size // ELEMENT_BYTES} elements")
        view[received : received + n] = chunk.data
        received += n
    if received != size or version < 0:
        raise PullStreamError(f"{what} ended after {received} of {size} bytes")
    return version
