"""Training a model larger than the trainer, a window of blocks at a time: the optimizer
(optimizer), what `offload(..., stream=Streaming(...))` is told and the errors a streamed
step raises (settings), the parameters cut into units (units), the pull half (window),
the push half (grads) and the step's end on the daemons (apply).
"""
