"""The TCP data plane: Pull and Push without gRPC's copies. The server's event loop
(server), who may hold a connection (connections) and one request served by a worker
(requests), through the same store calls, conversions and status codes as the gRPC
servicer (ps_offload.daemon.rpc). Beside it, the local transport for clients on this host:
the same requests, the bytes through shared memory (local_server).
"""
