"""FP8 casts and scaling recipes against a separate float64 reference: the nearest value of the
format's grid (all 256 codes decoded), ties to the even code, saturating at ±max; counts of
saturated and underflowed values; NaN refused by name; the delayed recipe's amax history step by
step; TP shards cast with the whole tensor's scale at TP2 and TP4."""

from __future__ import annotations

import pytest
import torch

from tpkernels.quant.fp8 import ScaleState, cast_to_fp8, CastStats, fp8_dtype, fp8_max, fp8_tiny, scale_from_amax


def _grid(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(finite values sorted, their codes) of the format, decoded from every byte."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(fp8_dtype(fmt)).double()
    keep = torch.isfinite(vals)
    vals, codes = vals[keep], codes[keep]
    order = torch.argsort(vals, stable=True)
    return vals[order], codes[order]


def _reference(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """float64 round to nearest (ties: the even code) on the grid, saturating at ±max."""
    vals, codes = _grid(fmt)
    y = (x.double() * scale).clamp(-fp8_max(fmt), fp8_max(fmt))
    out = torch.empty_like(y)
    for i, v in enumerate(y.flatten().tolist()):
        d = (vals - v).abs()
        best = d.min()
        cand = (d == best).nonzero().flatten()
        if len(cand) > 1:
            even = [c for c in cand.tolist() if int(codes[c]) % 2 == 0]
            cand = torch.tensor(even[:1] or cand[:1].tolist())
        out.view(-1)[i] = vals[cand[0]]
    return out


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cast_equals_the_float64_grid_rounding(fmt, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    top, tiny = fp8_max(fmt), fp8_tiny(fmt)
    x = torch.cat([torch.randn(300, generator=g) * 50, torch.randn(200, generator=g) * tiny * 4,  # subnormals
                   torch.tensor([0.0, -0.0, top, -top, top * 1.5, -top * 3, tiny / 2, tiny / 2.1, tiny * 0.75,
                                 1.0625, 1.1875])])  # ties
    stats = CastStats()
    q = cast_to_fp8(x, torch.tensor(1.0), fmt, stats=stats)
    assert q.dtype == fp8_dtype(fmt)
    torch.testing.assert_close(q.double(), _reference(x, 1.0, fmt), rtol=0, atol=0)
    assert int(stats.saturated) == int((x.abs() > top).sum()) >= 2
    assert int(stats.underflow) == int(((x != 0) & (_reference(x, 1.0, fmt) == 0)).sum()) >= 1
    assert float(stats.amax) == float(x.abs().max()) and stats.numel == x.numel()


def test_scale_maps_amax_to_the_max_and_handles_zero():
    s = scale_from_amax(torch.tensor([2.0, 0.0, 1e-45]), "e4m3")
    assert s[0] == 224.0 and s[1] == 1.0 and s[2] == 1.0  # max / amax; amax 0 or an overflowing scale: 1
    assert float(scale_from_amax(torch.tensor(2.0), "e4m3", margin=1)) == 112.0
    x = torch.randn(64, 33) * 1000
    st = ScaleState("current", "e4m3")
    q, scale = st.cast(x)
    assert float(q.float().abs().max()) == 448.0 and int(st.stats.saturated) == 0
    r = ScaleState("rowwise", "e4m3")
    q, scale = r.cast(x)
    assert scale.shape == (64, 1) and torch.equal(q.float().abs().amax(1), torch.full((64,), 448.0))


def test_nan_and_inf_are_refused_by_name():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight holds NaN or infinite values"):
            ScaleState("current", "e4m3").cast(torch.tensor([1.0, bad]), "weight")
    with pytest.raises(ValueError, match=r"fp8.recipe \('tensor'\) must be one of current, delayed, rowwise"):
        ScaleState("tensor", "e4m3")
    with pytest.raises(ValueError, match=r"fp8.history \(0\) must be a positive integer"):
        ScaleState("delayed", "e4m3", history=0)
    with pytest.raises(ValueError, match=r"fp8.amax_reduction \('mean'\)"):
        ScaleState("delayed", "e4m3", reduction="mean")
    with pytest.raises(ValueError, match=r"fp8 format \('e2m5'\)"):
        fp8_dtype("e2m5")


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_delayed_scaling_uses_the_history_of_previous_casts(reduction):
    st = ScaleState("delayed", "e4m3", history=3, reduction=reduction)
    amaxes = [2.0, 8.0, 1.0, 4.0, 0.5, 0.25]
    used = []
    for a in amaxes:
        x = torch.tensor([a, -a / 3, 0.1])
        _, scale = st.cast(x)
        used.append(448.0 / float(scale))  # the amax this cast's scale was taken from
    # the first cast has no history: its own amax; then the window of the previous 3 casts
    want = [2.0]
    for i in range(1, len(amaxes)):
        window = amaxes[max(0, i - 3):i]
        want.append(max(window) if reduction == "max" else window[-1])
    assert used == pytest.approx(want, rel=1e-6)
    # growing past the history's amax saturates (and says so); the current recipe never does
    before = st.take_stats()
    expect = sum(sum(v > u * (1 + 1e-6) for v in (a, a / 3, 0.1)) for a, u in zip(amaxes, want))
    assert before.numel == 18 and int(before.saturated) == expect >= 2  # 8.0 after a history of 2.0, ...
    _, _ = st.cast(torch.tensor([100.0]))
    assert int(st.take_stats().saturated) == 1


def _tp_worker(rank, world, seed, recipe):
    from tpkernels.parallel.mappings import all_gather_dim

    g = torch.Generator().manual_seed(seed)
    full = torch.randn(8, 4 * world, generator=g) * torch.logspace(-2, 2, 4 * world)  # columns of very different size
    shard = full.chunk(world, dim=1)[rank].contiguous()
    st = ScaleState(recipe, "e4m3", group=None, rows_span_group=True)
    q, scale = st.cast(shard)
    whole = ScaleState(recipe, "e4m3").cast(full)
    gathered = all_gather_dim(q.float().t().contiguous(), 0, None).t()
    torch.testing.assert_close(gathered, whole[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(scale, whole[1], rtol=0, atol=0)
    return float(scale.flatten()[0])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", ["current", "rowwise", "delayed"])
def test_tp_shards_share_the_whole_tensors_scale(rank_pool, fresh_seed, world, recipe):
    scales = rank_pool(world).run(_tp_worker, fresh_seed, recipe)
    assert len(set(scales)) == 1
