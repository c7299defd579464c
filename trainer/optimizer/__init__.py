"""The torch.optim.Optimizer whose state lives on the daemons: OffloadOptimizer (optimizer),
what it shares with the streamed one (daemon_optimizer), param groups (param_groups),
dynamic loss scaling (loss_scale), pushes during backward (backward_push), following a
model that moved (param_binding) and the parity audit (audit). `offload()` itself is
ps_offload.trainer.api.
"""
