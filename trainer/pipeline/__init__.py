"""Pipeline stages x data-parallel replicas under torchrun.

trainer                PipelineTrainer: GPipe/1F1B stages over the grid, its optimizer, clipping
grid                   RankGrid (a rank's stage and replica), init_distributed, split_layers
reducer                GradReducer: a stage's dp all-reduce in buckets started during backward
schedule_check         schedules as data (per-stage F/B orders) and their check
local_optimizer        StepOptimizer (the interface PipelineTrainer runs over) and LocalOptimizer,
                       the in-process optimizer behind it
compressed_allreduce   CompressedAllReduce: the dp all-reduce, compressed both ways with error feedback
"""
