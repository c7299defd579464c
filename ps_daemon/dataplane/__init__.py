"""The TCP data plane: Pull and Push without gRPC's copies, through the same store calls,
conversions and status codes as the gRPC servicer (ps_offload.daemon.rpc). Beside it, the
local transport for clients on this host: the same requests, the bytes through shared memory.

    server          the server's event loop: one selector thread, a worker pool, pulls parked
                    without a thread
    connections     who may hold a connection: the limits checked at accept, the parked pulls'
                    deadlines, the selector's waker
    requests        one request served by a worker: token, pull (or park), push
    local_server    LocalServer: the local transport (abstract Unix socket, peer uid checked, each
                    connection's memfd slot mapped; pulls written and pushes read in place,
                    alone or a batch of them in one round trip)
    batch_runs      how a local batch is served: runs of committing pushes to different shards
                    side by side (as the RAM tier allows), so their commits share groups
    local_session   a local connection's session (socket, slot, client id), its refusals, its peer
    local_pool      LocalPool: the node's shared pool (server.local_pool_bytes): each client's windows
"""
