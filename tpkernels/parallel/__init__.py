"""Parallel layouts: ParallelConfig and its validation rules."""

from tpkernels.parallel.config import RECOMPUTE_CHOICES, SCHEDULES, ParallelConfig, ParallelConfigError

__all__ = ["RECOMPUTE_CHOICES", "SCHEDULES", "ParallelConfig", "ParallelConfigError"]
