"""A push as it crosses the wire: the PushHeader and its payload, built once by whoever decides
the push and carried unchanged by every transport (gRPC's chunked Push stream, the data
plane's header-then-bytes exchange).

The trainer and ps-admin both build pushes here, so a new header field touches the contract
(proto/ps.proto), this producer and the daemon's consumer (ps_offload.daemon.rpc.conversions),
nothing between them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.channel import CHUNK_BYTES


@dataclass(frozen=True)
class Push:
    """One shard's push: `header` announces `len(data)` bytes laid out as its encoding."""

    header: ps_pb2.PushHeader
    data: memoryview

    @classmethod
    def build(
        cls,
        model: str,
        shard_id: int,
        data: memoryview,
        *,
        step: int,
        kind: int,
        lr: float | None = None,
        encoding: int = ps_pb2.RAW,
        variance_frozen_at: int | None = None,
        groups: Sequence[ps_pb2.GroupHyperparams] = (),
        grad_multiplier: float | None = None,
        part: int = 0,
        parts: int = 0,
        check_only: bool = False,
        speculate: bool = False,
    ) -> Push:
        """A push of `data` (bytes laid out as `encoding`: RAW fp32 values, or compressed or
        half precision, see proto/ps.proto and ps_offload.proto.payloads). `lr` None leaves the
        optional field unset (the daemon then uses the registered learning rate);
        `variance_frozen_at` is for MOMENTUM pushes; `groups` (every param group's settings for
        this step) and `grad_multiplier` (1/loss scale) for GRADIENT and APPLY pushes; `part`
        for GRADIENT_PART and `parts` (and `check_only`) for APPLY pushes; `speculate` (with
        the groups and grad_multiplier the APPLY is expected to name) for a GRADIENT_PART part 0
        the daemon may apply at once (proto/ps.proto, PushHeader.speculate)."""
        header = ps_pb2.PushHeader(
            model=model, shard_id=shard_id, step=step, kind=kind, encoding=encoding, dtype=ps_pb2.FLOAT32,
            nbytes=len(data), lr=lr, variance_frozen_at=variance_frozen_at, groups=list(groups),
            grad_multiplier=grad_multiplier, part=part, parts=parts, check_only=check_only,
            speculate=speculate,
        )  # fmt: skip
        return cls(header, data)

    def describe(self) -> str:
        """For messages: "push of shard 3 step 7"."""
        return f"push of shard {self.header.shard_id} step {self.header.step}"

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The encoded PushChunks of a gRPC Push stream: the header rides with the first
        `chunk_bytes` of data (an empty payload still sends one chunk, the header)."""
        yield codec.push_chunks.encode(self.header, self.data[:chunk_bytes])
        for start in range(chunk_bytes, len(self.data), chunk_bytes):
            yield codec.push_chunks.encode(None, self.data[start : start + chunk_bytes])
