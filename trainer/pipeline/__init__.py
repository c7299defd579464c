"""Pipeline stages x data-parallel replicas under torchrun: PipelineTrainer, the rank grid
and the gradient reducer (trainer), schedules as data and their check (schedule_check),
the in-process optimizer behind the same interface (local_optimizer) and the compressed
all-reduce (compressed_allreduce).
"""
