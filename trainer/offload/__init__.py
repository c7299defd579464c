"""The torch.optim.Optimizer whose state lives on the daemons, and its parts. `offload()`
itself is ps_offload.trainer.api.

    whole_model        OffloadOptimizer: the whole model on the trainer; step, hooks, delayed update
    daemon_optimizer   DaemonOptimizer: what it shares with the streamed one (the torch.optim face,
                       registration, groups, state_dict, loss scaler)
    param_groups       param groups <-> PushHeader.groups; refuses what the daemons cannot follow
    loss_scale         LossScaler: dynamic loss scaling for fp16 parameters, by GradScaler's rules
    backward_push      BackwardPushes: shards pushed as parts while backward still runs
    forward_waits      ForwardWaits: which pulls each module's forward waits for
    param_binding      ParamBinding: following a model that moved (is each parameter still the flat
                       buffer's tensor?); ParameterChanged
    audit              ParityAudit: the parity audit, one shard's step recomputed with torch.optim;
                       AuditMismatch
"""
