"""The trainer's side of the wire: the clients of the daemons, with deadlines and retries, over
gRPC, the TCP data plane or shared memory. Where the daemons are is ps_offload.proto.cluster.
Imports the contract (ps_offload.proto), the optimizer plug-ins (ps_offload.optimizers) and
ps_offload.trainer.config, nothing else of the trainer.

    sharded_client     ShardedClient over a model's plan: register, push, pull, deadlines, retries;
                       owns the two below
    transports         Transports: which transport reaches each daemon (local, data plane, gRPC)
    holders            ReplicaHolders: a replicated model's lost, replaced, fresh and stale holders
    daemon_client      DaemonClient (one daemon's gRPC channel), DaemonError, which codes are retried
    dataplane_client   DataPlaneClient: pooled connections to one daemon's TCP data plane
    local_client       LocalClient: pooled connections to the node's own daemon, each with a sealed
                       memfd slot
    transport          Transport: the methods (push, pull_into, close) the three clients implement
    host_windows       HostWindows: memfd windows this process shares with its node's daemons
    slot_region        SlotRegion: a streamed model's blocks at fixed addresses over a few reused slots
    replicas           a replicated model's checks at registration, and the repair of a lost daemon
                       (it asks ReplicaHolders and tells it)
    lost_probe         LostDaemonProbe: whether a lost daemon answers again, asked off the step's path
"""
