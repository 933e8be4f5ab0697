"""Split a model's layers into pipeline stages (and, for interleaving, model chunks)."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from tpkernels.parallel.config import positive_int_errors


def _param_count(m: nn.Module | None) -> int:
    return 0 if m is None else sum(p.numel() for p in m.parameters())


def _balanced_counts(sizes: list[int], stages: int, first_extra: int, last_extra: int) -> list[int]:
    """Contiguous split of ``sizes`` into ``stages`` non-empty groups minimising the largest group
    (the first and last groups also carry ``first_extra`` / ``last_extra``)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: minimal max load splitting the first i layers into k groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                load = prefix[i] - prefix[j] + (first_extra if k == 1 else 0) + (last_extra if k == stages else 0)
                cand = max(best[k - 1][j], load)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def split_layers(layers: Sequence[nn.Module], num_stages: int, virtual_stages: int = 1, *,
                 layer_counts: Sequence[int] | None = None, balance: str = "even",
                 first: nn.Module | None = None, last: nn.Module | None = None) -> list[nn.Sequential]:
    """One ``nn.Sequential`` per virtual stage (num_stages × virtual_stages of them, in pipeline
    order). ``first`` (e.g. the embedding) opens the first, ``last`` (e.g. the final norm and head)
    closes the last. Layers per stage: ``layer_counts`` if given, else ``balance="even"`` (the
    first L mod S stages get one more) or ``"params"`` (contiguous split minimising the largest
    stage's parameter count, embedding and head included). Virtual stage s runs on rank s mod
    num_stages as its chunk s // num_stages (``chunks_of_rank``)."""
    S = num_stages * virtual_stages
    L = len(layers)
    errs = positive_int_errors(num_stages=num_stages, virtual_stages=virtual_stages)
    if errs:
        raise ValueError(errs[0])
    if L < S:
        raise ValueError(f"number of layers ({L}) must be at least num_stages × virtual_stages "
                         f"({num_stages} × {virtual_stages} = {S})")
    if layer_counts is not None:
        counts = list(layer_counts)
        if len(counts) != S or sum(counts) != L or min(counts) < 1:
            raise ValueError(f"layer_counts ({counts}) must be {S} positive numbers summing to the number of "
                             f"layers ({L})")
    elif balance == "even":
        counts = [L // S + (1 if s < L % S else 0) for s in range(S)]
    elif balance == "params":
        counts = _balanced_counts([_param_count(m) for m in layers], S, _param_count(first), _param_count(last))
    else:
        raise ValueError(f"balance ({balance!r}) must be 'even' or 'params'")
    stages, i = [], 0
    for s, c in enumerate(counts):
        mods = list(layers[i:i + c])
        i += c
        if s == 0 and first is not None:
            mods.insert(0, first)
        if s == S - 1 and last is not None:
            mods.append(last)
        stages.append(nn.Sequential(*mods))
    return stages


def chunks_of_rank(stages: Sequence[nn.Module], rank: int, num_stages: int) -> list[nn.Module]:
    """The model chunks rank ``rank`` runs, by chunk index: virtual stages rank, rank + p, …"""
    return [stages[s] for s in range(rank, len(stages), num_stages)]
