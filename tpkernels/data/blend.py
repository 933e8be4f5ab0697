"""Weighted blending of several sources: ``data.source: "0.7 corpus_a 0.3 chat.jsonl"`` (Megatron's
spelling: weight, path, …; paths with spaces quoted) or, in a YAML/TOML file, a list of
``[weight, path]`` pairs or ``{weight, path}`` mappings.

    parse_blend("0.7 a 0.3 b")           # [(0.7, "a"), (0.3, "b")]; None for a single source
    data = Blend([a, b], [0.7, 0.3])     # batch(step, rows) -> TokenBatch

Row k of the stream comes from the source a fixed schedule of ``BLOCK`` slots assigns it (each slot
to the source furthest below its share so far, Megatron's greedy rule), and is that source's
row number ``count`` (how many earlier stream positions went to it), read from the source's own
stream: closed-form in k, so the batch of step k depends only on (seed, k).
"""

from __future__ import annotations

import shlex

import numpy as np
import torch

from tpkernels.data.batch import TokenBatch, number_pairs
from tpkernels.data.stream import step_positions

BLOCK = 1000


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


def schedule(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """(block,) source of each slot: the one furthest below its share of the slots so far."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts, out = np.zeros(len(w)), np.empty(block, dtype=np.int64)
    for g in range(block):
        j = int(np.argmax(w * (g + 1) - counts))
        out[g], counts[j] = j, counts[j] + 1
    return out


class Blend:
    """Sources (each with ``rows_at(positions)``) blended by ``weights`` (see the module docstring)."""

    def __init__(self, sources: list, weights: list[float]):
        self.sources, self.weights = sources, weights
        # the task the blend implies: its sources' when they agree; text beside chat records is SFT with
        # every text token supervised (TokenBatch.cat fills their masks)
        tasks = {getattr(src, "task", "pretrain") for src in sources}
        self.task = tasks.pop() if len(tasks) == 1 else "sft" if tasks <= {"sft", "pretrain"} else None
        self.slots = schedule(weights)
        onehot = np.eye(len(sources), dtype=np.int64)[self.slots]  # (block, sources)
        self.before = np.cumsum(onehot, 0) - onehot  # slots of each source before slot g within a block
        self.per_block = onehot.sum(0)

    def batch(self, step: int, rows: int) -> TokenBatch:
        return self.rows_at(step_positions(step, rows))

    def rows_at(self, positions: torch.Tensor) -> TokenBatch:
        pos = positions.numpy()
        block, off = np.divmod(pos, BLOCK)
        src = self.slots[off]
        nth = block * self.per_block[src] + self.before[off, src]
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
