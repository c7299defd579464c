"""Shards between the trainer's device and the wire.

flat               FlatParams: parameters and gradients as views into two flat buffers, laid out
                   as the plan
device             ShardMover: shards between the compute copy (any device, fp32/bf16/fp16) and
                   the wire; HostBuffers
accelerator        AcceleratorCopies: side-stream copies through pinned buffers, ordered by events
                   (the GPU-only module)
push_compression   PushCompressor: compressed pushes with error feedback; 1-bit Adam's momentum
shard_io           ShardIO: the initial push or resume, and one step's pushes and pulls in a
                   thread pool
"""
