"""Generated protobuf and gRPC code for proto/ps.proto (make proto), plus the chunk codec."""
