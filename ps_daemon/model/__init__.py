"""What a model is to a daemon, and the math it runs. Pure domain: no files, no locks across
shards, no transport. Imports the contract (ps_offload.proto), the kernels, the optimizer
plug-ins (ps_offload.optimizers) and ps_offload.daemon.errors only.

    spec            the spec RegisterModel declares (ModelSpec, ParamSpec), its validation and JSON form
    optimizer       ShardOptimizer: a shard's state tensors, step count and update, stepped by the model's
                    plug-in, equal to torch.optim; 1-bit Adam's momentum step
    encodings       the push encodings: payload sizes, parsing and validation
    kernel_digest   a digest of what every optimizer plug-in computes on its fixed probe: replicas must
                    round alike
    faults          testing aid: an update perturbed on purpose (PS_OFFLOAD_FAULT_PERTURB_STEP), for the
                    parity audit's test
"""
