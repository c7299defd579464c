"""Training a model larger than the trainer, a window of blocks at a time.

optimizer   StreamedOptimizer: a window of blocks on the trainer; hooks, part pushes, APPLY
settings    what `offload(..., stream=Streaming(...))` is told, and the errors a streamed step
            raises (StepLost, StepTorn)
units       StreamUnit, stream_units: the parameters cut into units that come and go together
window      BlockWindow, the pull half: which blocks are here, their pulls, prefetch
grads       BlockGradients, the push half: each block's gradient gathered from .grad and pushed
apply       PartsApplier: the step's end on the daemons, its parts checked, agreed on and applied
"""
