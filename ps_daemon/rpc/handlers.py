"""One piece of gRPC plumbing the server interceptors share (ps_offload.daemon.rpc.server_security's token check,
ps_offload.daemon.metrics' timing): a method handler rebuilt around another behaviour, of the same
kind (unary or streaming, each way) and with the same (de)serializers."""

from __future__ import annotations

from collections.abc import Callable

import grpc

_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


def rebuild(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable, bool], Callable]) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by wrap(behaviour, streams_replies): the new
    behaviour takes (request or request iterator, context) as the old one did, and returns
    a reply, or yields replies when `streams_replies`."""
    for attribute, make in _KINDS:
        behaviour = getattr(handler, attribute)
        if behaviour is not None:
            return make(
                wrap(behaviour, attribute.endswith("_stream")),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler
