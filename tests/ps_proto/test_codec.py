"""Unit tests for ps_proto/codec.py: the hand codec must agree with protobuf both ways, not
copy on decode, skip unknown fields and refuse truncated input."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from ps_offload.proto import codec, ps_pb2
from ps_offload.proto.codec import CodecError, pull_chunks, push_chunks

LONG_NAME = "model/" + "x" * 300  # header > 128 bytes: its length needs a 2-byte varint


def _pull_header(model: str = "gpt") -> ps_pb2.ShardHeader:
    return ps_pb2.ShardHeader(model=model, shard_id=7, version=42, numel=1 << 20, dtype=ps_pb2.FLOAT32)


def _push_header(model: str = "gpt") -> ps_pb2.PushHeader:
    return ps_pb2.PushHeader(
        model=model,
        shard_id=3,
        step=99,
        kind=ps_pb2.GRADIENT,
        encoding=ps_pb2.RAW,
        dtype=ps_pb2.BFLOAT16,
        nbytes=1 << 30,
        lr=1e-3,
    )


def _payload(n: int) -> bytes:
    return bytes((i * 31 + 7) % 256 for i in range(n))


# (codec, chunk message class, header factory)
KINDS = [
    pytest.param(pull_chunks, ps_pb2.PullChunk, _pull_header, id="pull"),
    pytest.param(push_chunks, ps_pb2.PushChunk, _push_header, id="push"),
]

# (header model name or None for no header, payload size)
CASES = [
    pytest.param("gpt", 100, id="header+data"),
    pytest.param("gpt", 0, id="header-only"),
    pytest.param(None, 100, id="data-only"),
    pytest.param(None, 0, id="nothing"),
    pytest.param("", 0, id="empty-header"),  # all-default header: present but zero bytes long
    pytest.param("gpt", 1, id="one-byte"),
    pytest.param("gpt", 127, id="127-bytes"),
    pytest.param("gpt", 128, id="128-bytes"),  # first 2-byte length
    pytest.param("gpt", 200, id="over-128"),
    pytest.param(None, 16383, id="16383-bytes"),
    pytest.param("gpt", 16384, id="16-KiB"),  # first 3-byte length
    pytest.param("gpt", 20_000, id="over-16-KiB"),
    pytest.param("gpt", 3 << 20, id="3-MiB"),
    pytest.param(LONG_NAME, 300, id="long-header"),
]


def _header(factory, model):
    """None for no header, an all-default header for "", else a filled-in header."""
    if model is None:
        return None
    return factory(model) if model else type(factory())()


@pytest.mark.parametrize(("chunk_codec", "message_cls", "factory"), KINDS)
@pytest.mark.parametrize(("model", "size"), CASES)
def test_codec_encoding_parses_as_generated_message(chunk_codec, message_cls, factory, model, size):
    header = _header(factory, model)
    data = _payload(size)
    wire = chunk_codec.encode(header, data)
    assert isinstance(wire, bytes)
    message = message_cls.FromString(wire)
    assert message.HasField("header") == (header is not None)
    if header is not None:
        assert message.header == header
    assert message.data == data
    # Same bytes as protobuf's own encoding: fields in order, no extras.
    expected = message_cls(header=header, data=data) if header is not None else message_cls(data=data)
    assert wire == expected.SerializeToString()


@pytest.mark.parametrize(("chunk_codec", "message_cls", "factory"), KINDS)
@pytest.mark.parametrize(("model", "size"), CASES)
def test_generated_encoding_decodes_with_codec(chunk_codec, message_cls, factory, model, size):
    header = _header(factory, model)
    data = _payload(size)
    message = message_cls(header=header, data=data) if header is not None else message_cls(data=data)
    chunk = chunk_codec.decode(message.SerializeToString())
    if header is None:
        assert chunk.header is None
    else:
        assert isinstance(chunk.header, type(header))
        assert chunk.header == header
    assert isinstance(chunk.data, memoryview)
    assert bytes(chunk.data) == data


def test_round_trip_through_codec():
    header = _push_header()
    data = _payload(5000)
    chunk = push_chunks.decode(push_chunks.encode(header, data))
    assert chunk.header == header
    assert bytes(chunk.data) == data


def test_encode_accepts_memoryview_of_typed_array():
    values = np.arange(4096, dtype=np.float32)
    wire = pull_chunks.encode(_pull_header(), memoryview(values))
    message = ps_pb2.PullChunk.FromString(wire)
    assert message.data == values.tobytes()
    assert len(message.data) == values.nbytes  # length counts bytes, not elements
    decoded = np.frombuffer(pull_chunks.decode(wire).data, dtype=np.float32)
    np.testing.assert_array_equal(decoded, values)


def test_empty_data_writes_no_data_field():
    assert pull_chunks.encode(None, b"") == b""
    assert pull_chunks.encode(None, memoryview(b"")) == b""
    header = _pull_header()
    assert pull_chunks.encode(header, b"") == b"\x0a" + bytes([header.ByteSize()]) + header.SerializeToString()


def test_decode_empty_input():
    chunk = pull_chunks.decode(b"")
    assert chunk.header is None
    assert bytes(chunk.data) == b""


# -- zero copy -------------------------------------------------------------------------------


def _address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def test_decode_data_shares_memory_with_input_bytes():
    data = _payload(20_000)
    buf = pull_chunks.encode(_pull_header(), data)
    chunk = pull_chunks.decode(buf)
    assert isinstance(chunk.data, memoryview)
    assert chunk.data.obj is buf
    start = len(buf) - len(data)
    assert _address(chunk.data) == _address(buf) + start


def test_decode_data_is_a_view_not_a_copy():
    data = _payload(1000)
    buf = bytearray(pull_chunks.encode(None, data))
    chunk = pull_chunks.decode(buf)
    assert chunk.data.obj is buf
    # Writing into the input shows through the decoded view.
    buf[-1] ^= 0xFF
    assert chunk.data[-1] == data[-1] ^ 0xFF
    assert np.shares_memory(np.frombuffer(chunk.data, np.uint8), np.frombuffer(buf, np.uint8))


# -- unknown fields --------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


UNKNOWN_FIELDS = [
    pytest.param(_key(2, 0) + _varint(300), id="varint"),
    pytest.param(_key(3, 0) + _varint((1 << 64) - 1), id="varint-10-bytes"),
    pytest.param(_key(4, 1) + bytes(range(8)), id="fixed64"),
    pytest.param(_key(5, 5) + bytes(range(4)), id="fixed32"),
    pytest.param(_key(6, 2) + _varint(3) + b"abc", id="length-delimited"),
    pytest.param(_key(7, 2) + _varint(200) + bytes(200), id="length-delimited-long"),
    pytest.param(_key(1000, 0) + _varint(1), id="large-field-number"),
    pytest.param(_key(16, 2) + _varint(2) + b"zz", id="field-16-length-delimited"),
]


@pytest.mark.parametrize("extra", UNKNOWN_FIELDS)
def test_unknown_fields_are_skipped(extra):
    header, data = _pull_header(), _payload(500)
    head = b"\x0a" + _varint(header.ByteSize()) + header.SerializeToString()
    body = b"\x7a" + _varint(len(data)) + data
    for wire in (extra + head + body, head + extra + body, head + body + extra, extra + extra + body):
        chunk = pull_chunks.decode(wire)
        expected = ps_pb2.PullChunk.FromString(wire)  # protobuf agrees the input is well formed
        assert chunk.header == (expected.header if expected.HasField("header") else None)
        assert bytes(chunk.data) == data == expected.data


def test_last_data_field_wins_like_protobuf():
    wire = b"\x7a\x01A" + b"\x7a\x02BC"
    assert bytes(pull_chunks.decode(wire).data) == ps_pb2.PullChunk.FromString(wire).data == b"BC"


# -- malformed input -------------------------------------------------------------------------


def test_every_truncation_raises_codec_error():
    header, data = _push_header(LONG_NAME), _payload(20_000)
    wire = push_chunks.encode(header, data)
    header_end = 1 + len(_varint(header.ByteSize())) + header.ByteSize()
    boundaries = {0, header_end, len(wire)}  # prefixes that end between fields are valid messages
    for cut in range(len(wire)):
        if cut in boundaries:
            continue
        with pytest.raises(CodecError):
            push_chunks.decode(wire[:cut])


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"\x7a", id="tag-only"),
        pytest.param(b"\x7a\x80", id="truncated-length-varint"),
        pytest.param(b"\x7a\x05abc", id="data-shorter-than-length"),
        pytest.param(b"\x0a\x10\x0a", id="header-shorter-than-length"),
        pytest.param(b"\x80", id="truncated-key"),
        pytest.param(b"\x10\xff\xff", id="truncated-unknown-varint"),
        pytest.param(b"\x2a\x04ab", id="truncated-unknown-length-delimited"),
        pytest.param(b"\xff" * 11, id="varint-too-long"),
        pytest.param(b"\x0b", id="wire-type-3-start-group"),
        pytest.param(b"\x0c", id="wire-type-4-end-group"),
        pytest.param(b"\x0e", id="wire-type-6"),
        pytest.param(b"\x0f", id="wire-type-7"),
    ],
)
def test_malformed_input_raises_codec_error(wire):
    with pytest.raises(CodecError):
        pull_chunks.decode(wire)


def test_codec_error_is_a_value_error():
    assert issubclass(codec.CodecError, ValueError)


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"\x19\x01\x02\x03", id="fixed64-cut"),
        pytest.param(b"\x7a\x01A\x1d\x01", id="fixed32-cut-after-data"),
    ],
)
def test_truncated_fixed_width_field_raises_codec_error(wire):
    with pytest.raises(DecodeError):
        ps_pb2.PullChunk.FromString(wire)  # protobuf calls this input truncated
    with pytest.raises(CodecError):
        pull_chunks.decode(wire)


def test_corrupt_header_raises_codec_error():
    wire = b"\x0a\x02\x08\x80"  # header of 2 bytes: key of field 1 varint, then a cut varint
    with pytest.raises(CodecError):
        push_chunks.decode(wire)
