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

    # One constructor per kind, each taking what that kind carries (proto/ps.proto, PushHeader),
    # so a push that names a field its kind does not carry cannot be written.

    @classmethod
    def gradient(
        cls, model: str, shard_id: int, data: memoryview, *, step: int, encoding: int = ps_pb2.RAW,
        groups: Sequence[ps_pb2.GroupHyperparams] = (), grad_multiplier: float | None = None, lr: float | None = None,
    ) -> Push:  # fmt: skip
        """The reduced gradient of `step` (`encoding`: RAW fp32, half precision or compressed),
        with every param group's settings (or the registered ones and `lr`) and 1/loss scale."""
        return cls.unchecked(model, shard_id, data, step=step, kind=ps_pb2.GRADIENT, encoding=encoding, groups=groups,
                          grad_multiplier=grad_multiplier, lr=lr)  # fmt: skip

    @classmethod
    def gradient_part(
        cls, model: str, shard_id: int, data: memoryview, *, step: int, part: int, encoding: int = ps_pb2.RAW,
        speculate: tuple[Sequence[ps_pb2.GroupHyperparams], float | None] | None = None,
    ) -> Push:  # fmt: skip
        """Part `part` of `step`'s gradient, held until its APPLY. `speculate` (part 0 only): the
        (groups, grad_multiplier) the APPLY is expected to name; the daemon may step with them now."""
        groups, multiplier = speculate if speculate is not None else ((), None)
        return cls.unchecked(model, shard_id, data, step=step, kind=ps_pb2.GRADIENT_PART, encoding=encoding, part=part,
                          speculate=speculate is not None, groups=groups, grad_multiplier=multiplier)  # fmt: skip

    @classmethod
    def apply(
        cls, model: str, shard_id: int, *, step: int, parts: int, groups: Sequence[ps_pb2.GroupHyperparams] = (),
        grad_multiplier: float | None = None, check_only: bool = False,
    ) -> Push:  # fmt: skip
        """Applies the `parts` parts of `step` (no payload); `check_only`: only says whether it could."""
        return cls.unchecked(model, shard_id, memoryview(b""), step=step, kind=ps_pb2.APPLY, parts=parts, groups=groups,
                          grad_multiplier=grad_multiplier, check_only=check_only)  # fmt: skip

    @classmethod
    def momentum(
        cls, model: str, shard_id: int, data: memoryview, *, step: int, encoding: int, lr: float | None,
        variance_frozen_at: int,
    ) -> Push:  # fmt: skip
        """1-bit Adam's momentum after `step` (one lr, no groups; exp_avg_sq frozen after
        `variance_frozen_at` updates)."""
        return cls.unchecked(model, shard_id, data, step=step, kind=ps_pb2.MOMENTUM, encoding=encoding, lr=lr,
                          variance_frozen_at=variance_frozen_at)  # fmt: skip

    @classmethod
    def parameters(cls, model: str, shard_id: int, data: memoryview, *, step: int = 0) -> Push:
        """A shard's initial values (fp32), taken only by a shard not yet initialized."""
        return cls.unchecked(model, shard_id, data, step=step, kind=ps_pb2.PARAMETERS)

    @classmethod
    def state(cls, model: str, shard_id: int, data: memoryview, *, step: int) -> Push:
        """A shard's master values and optimizer state at version `step` (a restore, a repair)."""
        return cls.unchecked(model, shard_id, data, step=step, kind=ps_pb2.STATE)

    @classmethod
    def unchecked(
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
        """A push with any header fields: what the constructors above build on, and what a test of
        the daemon's validation sends where no constructor would (`lr` None leaves the optional
        field unset: the daemon then uses the registered learning rate)."""
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
