"""Weighted blending of several sources: ``data.source: "0.7 corpus_a 0.3 chat.jsonl"`` (Megatron's
spelling: weight, path, …; paths with spaces quoted) or, in a YAML/TOML file, a list of
``[weight, path]`` pairs or ``{weight, path}`` mappings.

    parse_blend("0.7 a 0.3 b")                 # [(0.7, "a"), (0.3, "b")]; None for a single source
    data = Blend([a, b], [0.7, 0.3], ["a", "b"], run_rows=steps * global_batch)
    data.batch(step, rows)                     # TokenBatch

The schedule (Webster / Sainte-Laguë, the stride scheduling of a weighted round robin): the weights,
normalised, become integers ``W_j`` in the same proportions (the decimals as written; exact up to a
period ``S = sum W_j`` of ``2**30`` rows, and within ``2**-31`` of each share beyond). In every period
of ``S`` stream positions source j holds exactly ``W_j``: its n-th row of the period at the time
``(n + 1/2) / W_j``, positions taken in time order (ties: the source listed first). So the long-run
proportions are exact and every prefix of the stream is within a few rows of them (fewer than there
are sources), whatever the weight (a block of slots would give a weight below half a slot nothing and
round the others). Stream
position k is row ``count`` of its source (how many earlier positions went to it), read from the
source's own stream: closed-form in k (an integer binary search, no table), so the batch of step k
depends only on (seed, k).

A weight that cannot get a row is refused: one whose share rounds to zero rows per period, or (given
``run_rows``, the run's ``training.steps`` × global batch) one whose first row falls after the run.
"""

from __future__ import annotations

import math
import shlex
from fractions import Fraction

import numpy as np
import torch

from tpkernels.data.batch import TokenBatch, number_pairs
from tpkernels.data.stream import step_positions

PERIOD = 1 << 30  # the largest period: (2n + 1) * W_i * ... stays far inside int64 (< 2**61)


def parse_blend(source: str) -> list[tuple[float, str]] | None:
    try:
        parts = shlex.split(source)
    except ValueError:
        return None
    if len(parts) < 2:
        return None
    try:
        float(parts[0])
    except ValueError:
        return None
    if len(parts) % 2:
        raise ValueError(f"data.source ({source!r}) must be weight, path pairs (a blend), not {len(parts)} items")
    out = []
    for w, p in zip(parts[::2], parts[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"data.source ({source!r}): {w!r} is no weight (a blend is weight, path pairs)") from None
        if not weight > 0:
            raise ValueError(f"data.source ({source!r}): weight {w} of {p!r} must be > 0")
        out.append((weight, p))
    return out


def blend_spec(value) -> str:
    """A file's list of [weight, path] pairs / {weight, path} mappings as the data.source string."""
    parts = []
    for item in value:
        if isinstance(item, dict) and set(item) == {"weight", "path"}:
            w, p = item["weight"], item["path"]
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            w, p = item
        else:
            raise ValueError(f"data.source ({value!r}) must be a path or a list of [weight, path] pairs or "
                             f"{{weight, path}} mappings, not {item!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not isinstance(p, str):
            raise ValueError(f"data.source: {item!r} must be a number and a path")
        parts += [repr(float(w)), p]
    return shlex.join(parts)


def integer_weights(weights: list[float]) -> np.ndarray:
    """(sources,) int64 ``W`` in the proportions of ``weights``, reduced: the decimals as written when their
    common period fits ``PERIOD``, else the shares rounded to ``PERIOD`` (a share may round to 0)."""
    exact = [Fraction(repr(float(w))) for w in weights]
    total = sum(exact)
    shares = [w / total for w in exact]
    period = math.lcm(*(f.denominator for f in shares))
    W = [int(f * period) for f in shares] if period <= PERIOD else [round(float(f) * PERIOD) for f in shares]
    g = math.gcd(*W)
    return np.array([w // g if g else w for w in W], dtype=np.int64)


def _rank(W: np.ndarray, j: int, n: np.ndarray) -> np.ndarray:
    """Stream positions within a period taken before source j's n-th row (n: an int64 array, each < W[j]):
    n of its own, and from each other source i the rows whose time (2m + 1) / (2 W_i) comes earlier (a tie
    counted when i is listed first)."""
    out = n.copy()
    for i, w in enumerate(W.tolist()):
        if i == j:
            continue
        a = (2 * n + 1) * w  # times scaled by 2 * W_i * W_j: row m of i is before iff (2m + 1) W_j < a
        out += ((a - 1) // W[j] + 1) // 2
        if i < j:
            out += (a % W[j] == 0) & ((a // W[j]) % 2 == 1)
    return out


def schedule(W: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, row within the period) of each slot (int64 array, each in [0, sum W)) of the period."""
    src, row = np.full(len(slots), -1, dtype=np.int64), np.zeros(len(slots), dtype=np.int64)
    for j, w in enumerate(W.tolist()):
        # lo: how many of source j's rows come at or before the slot (rank is increasing in the row)
        lo, hi = np.zeros(len(slots), dtype=np.int64), np.full(len(slots), w, dtype=np.int64)
        while bool((lo < hi).any()):
            active = lo < hi
            mid = (lo + hi + 1) // 2
            ok = active & (_rank(W, j, np.maximum(mid - 1, 0)) <= slots)
            lo, hi = np.where(ok, mid, lo), np.where(active & ~ok, mid - 1, hi)
        n = np.maximum(lo - 1, 0)
        mine = (lo > 0) & (_rank(W, j, n) == slots)
        src[mine], row[mine] = j, n[mine]
    return src, row


class Blend:
    """Sources (each with ``rows_at(positions)``) blended by ``weights`` (see the module docstring)."""

    def __init__(self, sources: list, weights: list[float], names: list[str] | None = None,
                 run_rows: int | None = None):
        self.sources, self.weights = sources, weights
        names = names or [f"source {j}" for j in range(len(sources))]
        # the task the blend implies: its sources' when they agree; text beside chat records is SFT with
        # every text token supervised (TokenBatch.cat fills their masks)
        tasks = {getattr(src, "task", "pretrain") for src in sources}
        self.task = tasks.pop() if len(tasks) == 1 else "sft" if tasks <= {"sft", "pretrain"} else None
        self.W = integer_weights(weights)
        self.period = int(self.W.sum())
        share = [w / sum(weights) for w in weights]
        for j, w in enumerate(self.W.tolist()):
            if w == 0:
                raise ValueError(f"data.source: weight {weights[j]} of {names[j]!r} is {share[j]:.3g} of the blend, "
                                 f"below 2**-31: it never gets a row (raise it or drop the source)")
            first = int(_rank(self.W, j, np.zeros(1, dtype=np.int64))[0])
            if run_rows is not None and first >= run_rows:
                raise ValueError(f"data.source: weight {weights[j]} of {names[j]!r} ({share[j]:.3g} of the blend) "
                                 f"gets its first row at stream position {first}, after the run's {run_rows} rows "
                                 "(training.steps × the global batch): raise the weight or drop the source")

        # one pass over the blend's rows (validation): each source's rows once, the sources one after another
        self.first = np.cumsum([0] + [getattr(src, "rows", 0) for src in sources])
        self.rows = int(self.first[-1])

    def batch(self, step: int, rows: int) -> TokenBatch:
        return self.rows_at(step_positions(step, rows))

    def pass_at(self, positions: torch.Tensor) -> TokenBatch:
        """Rows of one pass over the sources' rows, weights aside (``positions`` < ``rows``; validation)."""
        j = np.searchsorted(self.first, positions.numpy(), side="right") - 1
        return self._gather(j, positions.numpy() - self.first[j])

    def rows_at(self, positions: torch.Tensor) -> TokenBatch:
        period, slot = np.divmod(positions.numpy().astype(np.int64), self.period)
        src, row = schedule(self.W, slot)
        return self._gather(src, period * self.W[src] + row)

    def _gather(self, src: np.ndarray, nth: np.ndarray) -> TokenBatch:
        """Row ``nth[i]`` of source ``src[i]``'s stream, for each i, in that order."""
        parts, order = [], []
        for j, s in enumerate(self.sources):
            at = np.nonzero(src == j)[0]
            if len(at):
                parts.append(s.rows_at(torch.from_numpy(nth[at])))
                order.append(at)
        out = TokenBatch.cat(parts)
        inverse = torch.from_numpy(np.argsort(np.concatenate(order), kind="stable"))
        out = out.map(lambda t: t[inverse])
        if out.pair_index is not None:
            out.pair_index = number_pairs(out.pair_index)
        return out
