"""The stream of rows: step k's global batch is the rows at stream positions k * rows … (k + 1) * rows - 1.

    idx = stream_rows(step_positions(step, rows), n_rows, seed)   # (rows,) indices into n packed rows

Epoch e = position // n visits the n rows in the permutation of (seed, e): the rows of a step
depend only on (seed, step) (and the global batch size), never on the layout, so a resumed or
re-laid-out run sees the same tokens.
"""

from __future__ import annotations

import torch


def step_positions(step: int, rows: int) -> torch.Tensor:
    """The stream positions of step ``step``'s rows: ``step * rows + i``."""
    return torch.arange(step * rows, (step + 1) * rows)


def stream_rows(positions: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Indices into ``n`` packed rows of the stream ``positions``: epoch e visits the rows in the
    permutation of (seed, e)."""
    idx = torch.empty(len(positions), dtype=torch.long)
    perms: dict[int, torch.Tensor] = {}
    for i, k in enumerate(positions.tolist()):
        epoch, j = divmod(k, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        idx[i] = perms[epoch][j]
    return idx
