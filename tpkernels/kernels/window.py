"""Window geometry: which keys a range of queries sees, and the kernel window that says so.

Positions are in one coordinate system (global token indices under context parallelism; key
indices for one dense call). Query p sees key t iff ``p − left ≤ t`` (unless left = -1) and
``t ≤ p + right`` (unless right = -1); causal attention is right = 0.

The attention kernels align their window to the bottom-right of each (m queries, n keys) call:
query i sees key j iff ``−left' ≤ j − i − (n − m) ≤ right'``. For queries [qs, qe) against keys
[ks, ke) that is the rule above when ``left' = left + E`` and ``right' = right − E``, with
E = ke − qe (the offset between the two ranges' ends). :func:`band` trims the ranges to the
queries that see some key and the keys some query sees first, which makes both sides ≥ 0, and
writes -1 for a side that constrains none of the remaining pairs (so a kernel takes its maskless
path there).
"""

from __future__ import annotations

from typing import NamedTuple


class Band(NamedTuple):
    """Queries [qs, qe) against keys [ks, ke), with the kernel window (left, right) of that call."""

    qs: int
    qe: int
    ks: int
    ke: int
    left: int
    right: int


def band(qs: int, qe: int, ks: int, ke: int, left: int, right: int) -> Band | None:
    """The sub-ranges of queries [qs, qe) and keys [ks, ke) that see each other under the window
    (left, right) (-1: no bound), with the kernel window of one call over them; None when no query
    sees any key. Every query of the result sees at least one key of it, and every key is seen."""
    if left >= 0:
        ks = max(ks, qs - left)  # no query before qs reaches further back
    if right >= 0:
        ke = min(ke, qe + right)  # nor any past qe − 1 further ahead
    if ks >= ke:
        return None
    if right >= 0:
        qs = max(qs, ks - right)  # queries whose window ends before the first key
    if left >= 0:
        qe = min(qe, ke + left)  # queries whose window starts after the last key
    if qs >= qe:
        return None
    end = ke - qe
    kl = -1 if left < 0 or (qe - 1) - ks <= left else left + end
    kr = -1 if right < 0 or (ke - 1) - qs <= right else right - end
    return Band(qs, qe, ks, ke, kl, kr)


def no_op_window(window: tuple[int, int], causal: bool, seqlen: int) -> tuple[int, int]:
    """``window`` with each side that cannot constrain a sequence of ``seqlen`` tokens set to -1
    (a side >= seqlen − 1); causal sets the right side to 0."""
    left, right = window
    left = -1 if left >= seqlen - 1 else left
    right = 0 if causal else (-1 if right >= seqlen - 1 else right)
    return left, right


__all__ = ["Band", "band", "no_op_window"]
