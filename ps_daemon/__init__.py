"""ps-daemon: the parameter server that holds a model's shards in RAM and on NVMe and steps
their optimizer. Its folders are layers, each importing only those below: app (server, cli and
the other modules here) -> dataplane -> rpc -> store -> model, tiers -> base (errors, config).

    model/        what a model is to a daemon and the math it runs (spec, optimizer, encodings)
    tiers/        where a shard's bytes live: the RAM tier, the NVMe arena files, their commit protocol
    store/        the shards this daemon holds and every operation on them (ShardStore); no gRPC
    rpc/          the front every transport shares: gRPC servicers, conversions, status codes, TLS
    dataplane/    the TCP data plane and the local transport: Pull and Push without gRPC's copies
    composition   the composition root: which tiers fill the store's roles (open_store, build_tiers)
    server        lifecycle: gRPC server, health, reflection, port file, SIGHUP reload, SIGTERM
    cli           `ps-daemon serve`: config file plus flag overrides
    config        TOML config: one frozen dataclass per section, strict loader
    errors        typed domain errors: plain exceptions, no grpc
    metrics       Prometheus: RPC and optimizer-step histograms, collectors over the store's counters
    systemd       sd_notify, the watchdog thread, journald log priorities
    local         LocalDaemon: a daemon subprocess on a free port (demo, tests, bench)
    ownership     what a daemon owns alone: its nvme_dir (flock, dropped with the process) and its ports
    cpus          server.cpus, server.scheduling and store.optimizer_threads: the CPUs its threads run on, and how
    health_port   server.health_listen: grpc.health.v1 alone in plaintext, for probes that cannot speak TLS
"""
