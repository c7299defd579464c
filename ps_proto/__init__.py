"""Generated protobuf and gRPC code for proto/ps.proto (make proto), plus the chunk codec and
what every side of the wire computes identically. Imports nothing else of ours.

    ps_pb2          generated (make proto): the messages of proto/ps.proto
    ps_pb2_grpc     generated (make proto): the ParameterServer and Admin stubs and servicers
    codec           the hand-written encoder/decoder of the bulk streams' PullChunk / PushChunk
    push            Push: a push's header and payload, built once and carried unchanged by either
                    transport; the gRPC chunk stream
    payloads        the byte layouts of compressed push payloads (ONEBIT, BF16/FP16, TOPK)
    pull            a Pull stream reassembled into one buffer, checked once (trainer and ps-admin)
    frames          length-prefixed framing of the TCP data plane and the local transport
    plan            the shard plan: which slice of the parameters each shard holds, which daemon owns it
    channel         what both ends of a channel agree on: chunk size, message limits, method paths
    security        ClientSecurity (TLS, mutual TLS, token file) for trainers and ps-admin
    memory          the allocator setting for the bulk streams; mem_available (the host's MemAvailable)
    shared_memory   sealed memfds and SharedMapping: the memory a rank shares with its node's daemon
    cluster         daemon_addresses(): where the daemons are, one ordered list in every trainer process
"""
