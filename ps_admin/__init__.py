"""ps-admin: the operator's command line over the daemons' Admin RPCs. A pure client: it
imports the contract package (ps_offload.proto) and nothing from the daemon."""
