"""The trainer's side of the wire: the gRPC client to one daemon and the ShardedClient
over a model's plan, with deadlines and retries (sharded_client), the TCP data plane
client (dataplane_client), and where the daemons are (cluster). Imports the contract
(ps_offload.proto) and ps_offload.trainer.config only.
"""
