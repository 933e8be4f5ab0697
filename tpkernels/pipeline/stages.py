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


def stage_sizes(num_layers: int, num_stages: int, virtual_stages: int = 1, *, layer_counts: Sequence[int] | None = None,
                balance: str = "even", layer_params: Sequence[int] | None = None, first_params: int = 0,
                last_params: int = 0) -> list[int]:
    """Layers per virtual stage (num_stages × virtual_stages numbers, in pipeline order): ``layer_counts``
    if given, else ``balance="even"`` (the first L mod S stages get one more) or ``"params"``
    (contiguous split minimising the largest stage's parameter count: ``layer_params`` per layer,
    ``first_params`` / ``last_params`` on the first / last stage)."""
    S, L = num_stages * virtual_stages, num_layers
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
        return counts
    if balance == "even":
        return [L // S + (1 if s < L % S else 0) for s in range(S)]
    if balance == "params":
        return _balanced_counts(list(layer_params), S, first_params, last_params)
    raise ValueError(f"balance ({balance!r}) must be 'even' or 'params'")


def split_layers(layers: Sequence[nn.Module], num_stages: int, virtual_stages: int = 1, *,
                 layer_counts: Sequence[int] | None = None, balance: str = "even",
                 first: nn.Module | None = None, last: nn.Module | None = None) -> list[nn.Sequential]:
    """One ``nn.Sequential`` per virtual stage (num_stages × virtual_stages of them, in pipeline
    order), of :func:`stage_sizes` layers each. ``first`` (e.g. the embedding) opens the first,
    ``last`` (e.g. the final norm and head) closes the last; with ``balance="params"`` they count
    in the split. Virtual stage s runs on rank s mod num_stages as its chunk s // num_stages
    (``chunks_of_rank``)."""
    counts = stage_sizes(len(layers), num_stages, virtual_stages, layer_counts=layer_counts, balance=balance,
                         layer_params=[_param_count(m) for m in layers] if balance == "params" else None,
                         first_params=_param_count(first), last_params=_param_count(last))
    S = len(counts)
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
