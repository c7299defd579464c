"""The front every transport shares: the gRPC servicers and the data path both fronts call.
Imports the store; the store never imports it, and it never imports ps_offload.daemon.dataplane.

    servicer          the gRPC servicers (protobuf <-> store, nothing more): handler tables built
                      from the descriptors
    data_path         what both fronts call: receive_push (one push checked, staged, parsed, applied)
                      and serve_pull
    conversions       the protobuf <-> domain conversions both fronts validate with (PushRequest,
                      PullRequest, specs, plans, answers)
    status            the one mapping of domain errors to status codes, for the servicers and the data plane
    staging           StagingPool: the reusable fp32 buffers pushes land in
    server_security   TLS and bearer tokens on the server side: credentials, the token rule, its interceptor
    handlers          handler plumbing for the interceptors: a method handler rebuilt around another behaviour
    call_bounds       what one gRPC call can hold: calls per client address, a call stalled on its client
                      cut off
    fronts            Fronts: what the gRPC, data plane and local fronts say of their clients (Stats, metrics)
"""
