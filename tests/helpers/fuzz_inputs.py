"""Hypothesis strategies for the fuzz suite (tests/integration/test_fuzz.py): any message of
proto/ps.proto, built from its descriptor, with the numbers and names a careless or hostile
client sends (negative, huge, NaN, inf, 1e300, empty, long, unicode), and raw bytes.

Names: requests name the fuzz suite's own models ("fuzz", registered and trained by the
fuzzing), unknown ones, or odd strings; never the model the suite keeps to compare bit for
bit ("kept"), except in calls that only read it (KEPT_READERS), so that a request that
happens to be valid cannot change it legitimately."""

from __future__ import annotations

import math
import struct

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from ps_offload.proto import ps_pb2

KEPT = "kept"
FUZZ = "fuzz"
# Calls that never change a model's values: the fuzz may name the kept model in these.
KEPT_READERS = {
    "Pull",
    "GetShard",
    "ListShards",
    "GetModel",
    "Verify",
    "Evict",
    "Load",
    "Prefetch",
    "RegisterModel",
    "ListSnapshots",
}

_INT_BOUNDS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-3, 0.1, 1.0, -1.0, 0.9, 0.999, 1e300, -1e300, math.inf, -math.inf, math.nan]),
    st.floats(allow_nan=True, allow_infinity=True),
)


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [
        v for v in (0, 1, 2, 3, 4096, 2**20, 2**31 - 1, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1, -1) if low <= v <= high
    ]
    return st.one_of(
        st.sampled_from(edges), st.integers(min(max(low, -5), high), min(high, 40)), st.integers(low, high)
    )


def names(kept: bool) -> st.SearchStrategy[str]:
    known = [FUZZ, "nope", ""] + ([KEPT] if kept else [])
    odd = ["m" * 300, "é" * 50, "a/b", "\x00", "../x", "m" * 200]
    return st.one_of(
        st.sampled_from(known), st.sampled_from(odd), st.text(max_size=12), st.text(min_size=60, max_size=90)
    )


def _field(field: FieldDescriptor, depth: int, kept: bool) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        single = messages(field.message_type, depth + 1, kept) if depth < 3 else st.just(None)
    elif field.type == FieldDescriptor.TYPE_STRING:
        single = names(kept) if field.name in ("model", "name") else st.text(max_size=16)
    elif field.type == FieldDescriptor.TYPE_BYTES:
        single = st.binary(max_size=64)
    elif field.type == FieldDescriptor.TYPE_BOOL:
        single = st.booleans()
    elif field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        single = _FLOATS
    elif field.type == FieldDescriptor.TYPE_ENUM:
        single = st.integers(0, max(v.number for v in field.enum_type.values) + 2)  # unknown values too
    else:
        single = _ints(*_INT_BOUNDS[field.type])
    if field.is_repeated:
        return st.lists(single, max_size=3)
    return single


def messages(descriptor: Descriptor, depth: int = 0, kept: bool = False) -> st.SearchStrategy:
    """Messages of `descriptor` with any subset of their fields set to hostile values."""
    cls = message_factory.GetMessageClass(descriptor)
    optional = {f.name: _field(f, depth, kept) for f in descriptor.fields}

    def build(values: dict) -> object:
        message = cls()
        for name, value in values.items():
            field = descriptor.fields_by_name[name]
            if value is None:
                continue
            if field.is_repeated:
                if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
                    for item in value:  # a map field: its entries by key
                        if item is not None:
                            getattr(message, name)[item.key] = item.value
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    for item in value:
                        if item is not None:
                            getattr(message, name).add().CopyFrom(item)
                else:
                    getattr(message, name).extend(value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries({}, optional=optional).map(build)


_SMALL = st.integers(0, 3)


class _Mutations:
    """Inputs one or two steps from valid reach the checks deep in the daemon, which wholly
    random messages rarely get past: each example picks at most two of its fields to make
    hostile (at least one: the valid inputs come from the other fields' values and from
    the hostile values that happen to be valid), and every other field gets a valid value."""

    def __init__(self, draw, keys: list[str]) -> None:
        self.draw = draw
        self.hostile = draw(st.sets(st.sampled_from(keys), min_size=1, max_size=2))

    def __call__(self, key: str, valid: st.SearchStrategy, hostile: st.SearchStrategy):
        return self.draw(hostile if key in self.hostile else valid)


_REGISTRATION_KEYS = ["name", "params", "shape", "dtype", "weight_decay", "group", "optimizer", "shard_bytes",
                      "daemons", "daemon_index"]  # fmt: skip


@st.composite
def registrations(draw) -> object:
    """RegisterModelRequests near a valid one (never of the kept model)."""
    field = _Mutations(draw, _REGISTRATION_KEYS)
    name = field("name", st.sampled_from([f"{FUZZ}-{i}" for i in range(3)]), names(kept=False))
    spec = ps_pb2.ModelSpec(model=name)
    for i in range(field("params", st.integers(1, 3), st.sampled_from([0, 40]))):
        param = spec.params.add(name=f"p{i}")
        param.shape.extend(field("shape", st.lists(st.integers(1, 700), min_size=1, max_size=2),
                                 st.lists(_ints(-(2**63), 2**63 - 1), max_size=3)))  # fmt: skip
        param.dtype = field("dtype", st.sampled_from([1, 2, 3]), st.integers(0, 9))
        if draw(st.booleans()):
            param.weight_decay = field("weight_decay", st.just(0.0), _FLOATS)
        param.group = field("group", st.just(0), _ints(0, 2**32 - 1))
        param.starts_shard = draw(st.booleans())
    hostile = "optimizer" in field.hostile
    number = (lambda valid: draw(_FLOATS)) if hostile else (lambda valid: valid)
    if draw(st.booleans()):
        spec.optimizer.adamw.CopyFrom(
            ps_pb2.AdamWSpec(
                lr=number(1e-3), beta1=number(0.9), beta2=number(0.999), eps=number(1e-8), weight_decay=number(0.01)
            )  # fmt: skip
        )
    else:
        spec.optimizer.sgd.CopyFrom(
            ps_pb2.SGDSpec(lr=number(0.1), momentum=number(0.9), dampening=number(0.0), nesterov=draw(st.booleans()))
        )
    spec.shard_bytes = field("shard_bytes", st.sampled_from([0, 4096, 8192]), _ints(0, 2**64 - 1))
    spec.daemons.extend(field("daemons", st.just(["d0"]), st.lists(st.text(max_size=6), max_size=3)))
    return ps_pb2.RegisterModelRequest(spec=spec, daemon_index=field("daemon_index", st.just(0), _ints(0, 2**32 - 1)))


_PUSH_KEYS = ["shard_id", "step", "kind", "encoding", "dtype", "nbytes", "lr", "variance_frozen_at", "groups",
              "grad_multiplier", "part", "parts", "check_only", "payload"]  # fmt: skip


@st.composite
def push_headers(draw, shard_numels: tuple[int, ...]) -> tuple[object, bytes]:
    """A PushHeader for the fuzz model near a valid one, and a payload of about its size."""
    field = _Mutations(draw, _PUSH_KEYS)
    header = ps_pb2.PushHeader(model=FUZZ)
    shard_id = field("shard_id", st.integers(0, len(shard_numels) - 1), _ints(0, 2**32 - 1))
    header.shard_id = shard_id
    header.step = field("step", st.integers(0, 3), _ints(0, 2**64 - 1))
    header.kind = field("kind", st.sampled_from([1, 4, 5]), st.integers(0, 6))  # GRADIENT, GRADIENT_PART, APPLY
    header.encoding = field("encoding", st.just(1), st.integers(0, 8))
    header.dtype = field("dtype", st.just(1), st.integers(0, 5))
    numel = shard_numels[shard_id] if shard_id < len(shard_numels) else 16
    header.nbytes = field("nbytes", st.just(4 * numel), _ints(0, 2**64 - 1))
    if "lr" in field.hostile:
        header.lr = draw(_FLOATS)
    if "variance_frozen_at" in field.hostile:
        header.variance_frozen_at = draw(_ints(0, 2**64 - 1))
    if "groups" in field.hostile:
        for _ in range(draw(st.integers(1, 2))):
            header.groups.add(lr=draw(_FLOATS), weight_decay=draw(_FLOATS), beta1=draw(_FLOATS), beta2=draw(_FLOATS),
                              eps=draw(_FLOATS), momentum=draw(_FLOATS), dampening=draw(_FLOATS))  # fmt: skip
    if "grad_multiplier" in field.hostile:
        header.grad_multiplier = draw(_FLOATS)
    header.part = field("part", _SMALL, _ints(0, 2**32 - 1))
    header.parts = field("parts", _SMALL, _ints(0, 2**32 - 1))
    header.check_only = field("check_only", st.just(False), st.just(True))
    size = min(header.nbytes, 4 * max(shard_numels) + 64)
    values = field("payload", st.lists(st.floats(-1, 1, width=32), min_size=1, max_size=4),
                   st.lists(_FLOATS, min_size=1, max_size=4))  # fmt: skip
    payload = (float32_bytes(values) * (size // (4 * len(values)) + 1))[:size]
    return header, payload


def float32_bytes(values: list[float]) -> bytes:
    """fp32 little-endian values; those past fp32's range become infinities of their sign."""
    return b"".join(
        struct.pack("<f", v) if math.isnan(v) or abs(v) < 3.4e38 else struct.pack("<f", math.copysign(math.inf, v))
        for v in values
    )
