"""Pipeline parallelism (torch.distributed.pipelining): stages on their own devices or sub-meshes,
microbatches, and schedules whose plans equal torch's.

Example (8 virtual CPUs, 4 stages of 2 devices each)::

    stages = [PipelineStage(block, i, 4, f"CPU:{2 * i}") for i, block in enumerate(blocks)]
    schedule = ScheduleGPipe(stages, n_microbatches=4, loss_fn=lambda y, t: tf.reduce_mean((y - t) ** 2))
    schedule.step(x, target=y)
    grads = [stage.grads for stage in stages]
"""

from tfdist.pipelining._ir import Pipe, PipeInfo, SplitPoint, build_stage, pipe_split, pipeline
from tfdist.pipelining._plot import plot_schedule, timeline
from tfdist.pipelining._profile import PipelineProfile, read_profile
from tfdist.pipelining._actions import Action, ComputationType, format_pipeline_order
from tfdist.pipelining.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from tfdist.pipelining.schedules import (
    PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
    PipelineStallError, ScheduleDualPipeV, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
)
from tfdist.pipelining.stage import PipelineStage, PipeliningShapeError

__all__ = [
    "PipelineStage", "PipeliningShapeError", "TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks",
    "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "plot_schedule", "timeline", "read_profile", "PipelineProfile", "pipeline", "pipe_split", "SplitPoint", "Pipe", "PipeInfo", "build_stage",
    "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "Action", "ComputationType", "format_pipeline_order",
    "PipelineStallError",
]
