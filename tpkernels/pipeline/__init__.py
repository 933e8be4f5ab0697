"""Pipeline parallelism: schedules as data, a simulator that checks them, a P2P engine and a runtime
that executes any schedule on real stages, and a per-action timeline."""

from tpkernels._lazy import lazy_names

# each name imports its module on first use (PEP 562): the planner reads the schedules and the
# simulator, pure Python, without the engine's torch
_WHERE = {
    **dict.fromkeys(("P2P", "PipelineAbortError", "PipelinePeerLostError", "PipelineTimeoutError"), "p2p"),
    **dict.fromkeys(("PipelineRuntime", "split_microbatches"), "runtime"),
    **dict.fromkeys(("SCHEDULES", "Action", "ScheduleError", "communication", "forward_only", "gpipe",
                     "interleaved_1f1b", "make_schedule", "one_f_one_b", "zb_h1"), "schedules"),
    **dict.fromkeys(("Costs", "SimResult", "simulate", "validate"), "simulator"),
    **dict.fromkeys(("chunks_of_rank", "split_layers"), "stages"),
}

__all__ = [
    "P2P", "SCHEDULES", "Action", "Costs", "PipelineAbortError", "PipelinePeerLostError", "PipelineRuntime",
    "PipelineTimeoutError",
    "ScheduleError", "SimResult", "chunks_of_rank", "communication", "forward_only", "gpipe", "interleaved_1f1b", "make_schedule",
    "one_f_one_b", "simulate", "split_layers", "split_microbatches", "validate", "zb_h1",
]

__getattr__ = lazy_names(__name__, _WHERE)
