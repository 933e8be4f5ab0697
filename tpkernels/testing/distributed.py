"""The multi-rank test harness: :mod:`tpkernels.parallel.local_ranks` under the name the tests use."""

from tpkernels.parallel.local_ranks import RankError, RankExited, RankPool, RankTimeoutError, run_on_ranks

__all__ = ["RankError", "RankExited", "RankPool", "RankTimeoutError", "run_on_ranks"]
