"""The front every transport shares: the gRPC servicers (protobuf <-> store, nothing
more), the protobuf <-> domain conversions both fronts validate with (conversions), the
one mapping of domain errors to status codes (status), TLS and bearer tokens on the
server side (server_security), handler plumbing for interceptors (handlers) and the
staging buffers pushes land in (staging). Imports the store; the store never imports it.
"""
