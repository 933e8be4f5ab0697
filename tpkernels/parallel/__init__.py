"""Parallel layouts: ParallelConfig and its validation rules."""

from tpkernels.parallel.config import CP_ALGOS, RECOMPUTE_CHOICES, SCHEDULES, ParallelConfig, ParallelConfigError

__all__ = ["CP_ALGOS", "RECOMPUTE_CHOICES", "SCHEDULES", "ParallelConfig", "ParallelConfigError"]
