"""Pipeline parallelism: schedules as data, a simulator that checks them, a P2P engine and a runtime
that executes any schedule on real stages, and a per-action timeline."""

from tpkernels.pipeline.p2p import P2P, PipelineAbortError, PipelinePeerLostError, PipelineTimeoutError
from tpkernels.pipeline.runtime import PipelineRuntime, split_microbatches
from tpkernels.pipeline.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    communication,
    forward_only,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zb_h1,
)
from tpkernels.pipeline.simulator import Costs, SimResult, simulate, validate
from tpkernels.pipeline.stages import chunks_of_rank, split_layers

__all__ = [
    "P2P", "SCHEDULES", "Action", "Costs", "PipelineAbortError", "PipelinePeerLostError", "PipelineRuntime",
    "PipelineTimeoutError",
    "ScheduleError", "SimResult", "chunks_of_rank", "communication", "forward_only", "gpipe", "interleaved_1f1b", "make_schedule",
    "one_f_one_b", "simulate", "split_layers", "split_microbatches", "validate", "zb_h1",
]
