"""ps-admin: the operator's command line over the daemons' Admin RPCs. A pure client: it
imports the contract package (ps_offload.proto) and nothing from the daemon.

    __main__          `python -m ps_offload.admin` runs the command line
    cli               `ps-admin`: models, shards, shard, stats, verify, export, health, evict,
                      prefetch, drop (the commands only)
    snapshot_cli      `ps-admin snapshot take / list / delete / restore / export` (the commands only)
    cluster_file      `ps-admin cluster-file`: a Slurm node list as the job's cluster file
    options           what every command shares: default daemon, option types, the failure line
    client            the Admin client: channels via ClientSecurity, one AdminError line per failed RPC
    views             responses as plain dicts (what --json prints) and the tables built from them
    export            `ps-admin export`: every shard pulled from its daemons, written as safetensors
    snapshots         snapshots across a model's daemons (all or none); which holder each shard is read from
    snapshot_restore  a snapshot restored onto a re-cut plan (loads torch, so apart from snapshots)
    snapshot_files    a snapshot exported into a directory (safetensors, a manifest with crc32c),
                      resumable, and restored from one
    replicas          `ps-admin replicas MODEL`: each shard's holders and versions; the degraded ones
"""
