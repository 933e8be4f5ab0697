"""Parallel layouts: ParallelConfig and its validation rules."""

from tpkernels.parallel.config import RECOMPUTE_CHOICES, ParallelConfig, ParallelConfigError

__all__ = ["RECOMPUTE_CHOICES", "ParallelConfig", "ParallelConfigError"]
