"""Pipeline parallelism on the placement API, with torch.distributed.pipelining's names.

``PipelineStage`` wraps one piece of the model on one pp rank; a schedule runs micro-batches
through the stages of every rank. DTensor activations (TP / sequence-parallel stages) cross
stages as DTensors on the next stage's sub-mesh, and fsdp-sharded stages all-gather and
reduce-scatter once per step. See docs/pipelining.md.
"""
from .microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from .schedules import (PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B,
                        ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                        ScheduleLoopedBFS, ScheduleZBVZeroBubble, get_schedule_class)
from .stage import PipelineStage

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
           "PipelineScheduleSingle",
           "PipelineScheduleMulti", "get_schedule_class", "TensorChunkSpec",
           "split_args_kwargs_into_chunks", "merge_chunks"]
