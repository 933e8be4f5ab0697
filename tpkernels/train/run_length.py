"""The run's length in passes over the data: ``training.epochs`` made into steps, and what a run reads
said at its start (and by ``--dry-run``, with the data's summary).

    cfg = resolve_epochs(cfg, data, global_batch)     # training.epochs 2 -> training.steps = ceil(2 × rows / batch)
    print(epochs_line(cfg, data, global_batch))       # "data: 37 packed rows; 10 steps × 8 rows read 80: 2.16 epochs"

An epoch is one pass over the data's packed rows (a file's rows of ``data.seq_length`` tokens, a
records file's samples packed into rows; a blend: its sources' rows together): the stream visits
every row once per epoch, in a fresh order each (:mod:`tpkernels.data.stream`). Synthetic sources
are endless and have no epochs.
"""

from __future__ import annotations

import dataclasses
import math


def data_rows(data) -> int | None:
    """The packed rows of one pass over ``data``, or None for an endless (synthetic) source."""
    n = getattr(data, "rows", None)
    return int(n) if n else None


def resolve_epochs(cfg, data, global_batch: int):
    """``cfg`` with ``training.epochs`` made into ``training.steps`` (epochs cleared: a resolved config);
    ``cfg`` itself when no epochs are set."""
    t = cfg.training
    if t.epochs is None:
        return cfg
    rows = data_rows(data)
    if rows is None:
        raise ValueError(f"training.epochs ({t.epochs}) needs a data.source of finite size (a file, records or an "
                         f"indexed corpus); {cfg.data.source!r} is endless: give training.steps")
    steps = max(1, math.ceil(t.epochs * rows / global_batch - 1e-9))
    return dataclasses.replace(cfg, training=dataclasses.replace(t, steps=steps, epochs=None)).check()


def epochs_line(cfg, data, global_batch: int, epochs: float | None = None) -> str | None:
    """What the run reads, in epochs of the data (None for an endless source); ``epochs``: the
    ``training.epochs`` the steps were made from."""
    rows = data_rows(data)
    if rows is None:
        return None
    steps = cfg.training.steps
    read = steps * global_batch
    how = f"training.epochs {epochs:g} -> " if epochs is not None else ""
    return (f"data: {rows:,} packed rows of {cfg.data.seq_length} tokens; {how}{steps} steps × {global_batch} rows "
            f"read {read:,}: {read / rows:.3g} epochs")


def data_summary(data) -> str | None:
    """Chat / preference data: samples (pairs), packed rows, the share of the rows' tokens that are
    supervised and of the rows that is padding; None for other sources."""
    packed = getattr(data, "packed", None)
    if packed is None or not hasattr(packed, "mask"):
        return None
    tokens = packed.mask.numel()
    supervised = int(packed.mask.sum())
    filled = int(packed.filled.sum()) if hasattr(packed, "filled") else tokens
    what = f"{packed.num_pairs:,} preference pairs" if getattr(packed, "pairs", False) else \
        f"{packed.samples:,} samples"
    return (f"data: {what} ({getattr(data, 'format', '?')}, task {getattr(data, 'task', '?')}) packed into "
            f"{packed.rows:,} rows of {packed.seq} tokens; supervised tokens {supervised:,} of {filled:,} "
            f"({100 * supervised / max(filled, 1):.1f}%; padding {100 * (1 - filled / tokens):.1f}% of the rows)")


__all__ = ["data_rows", "data_summary", "epochs_line", "resolve_epochs"]
