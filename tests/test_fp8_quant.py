"""FP8 casts and the FP8 run state against separate float64 references: the nearest value of the
format's grid (all 256 codes decoded), ties to the even code, saturating at ±max; counts of saturated
and underflowed values; the scale as the correctly rounded fp32 quotient; NaN refused by name; the
delayed recipe's amax history step by step (one push per step, none from a frozen pass or outside a
training step); the state's checkpoint tensors round-trip; TP shards cast with the whole tensor's
scale at TP2 and TP4."""

from __future__ import annotations

import pytest
import torch

from tpkernels.quant.fp8 import cast_counts, cast_to_fp8, fp8_dtype, fp8_max, fp8_tiny, scale_from_amax
from tpkernels.quant.fp8_state import Fp8Guard, Fp8Recipe, Fp8State, fp8_frozen


def _state(recipe: str = "current", names=("lin",), **kw) -> Fp8State:
    return Fp8State(Fp8Recipe(recipe, **kw), list(names), guard=Fp8Guard(steps=1))


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
    q = cast_to_fp8(x, torch.tensor(1.0), fmt)
    assert q.dtype == fp8_dtype(fmt)
    torch.testing.assert_close(q.double(), _reference(x, 1.0, fmt), rtol=0, atol=0)
    saturated, underflow = cast_counts(x, torch.tensor(1.0), q, fmt).tolist()
    assert int(saturated) == int((x.abs() > top).sum()) >= 2
    assert int(underflow) == int(((x != 0) & (_reference(x, 1.0, fmt) == 0)).sum()) >= 1


def test_scale_maps_amax_to_the_max_and_handles_zero():
    s = scale_from_amax(torch.tensor([2.0, 0.0, 1e-45]), "e4m3")
    assert s[0] == 224.0 and s[1] == 1.0 and s[2] == 1.0  # max / amax; amax 0 or an overflowing scale: 1
    assert float(scale_from_amax(torch.tensor(2.0), "e4m3", margin=1)) == 112.0
    x = torch.randn(64, 33) * 1000
    st = _state("current")
    q, scale = st.cast(0, "x", x)
    assert float(q.float().abs().max()) == 448.0 and int(st.counts[0, 0, 1]) == 0
    q, scale = _state("rowwise").cast(0, "x", x)
    assert scale.shape == (64, 1) and torch.equal(q.float().abs().amax(1), torch.full((64,), 448.0))
    q, scale = _state("rowwise", margin=2).cast(0, "w", x)  # the margin holds for rowwise casts too
    assert torch.equal(q.float().abs().amax(1), torch.full((64,), 112.0))


@pytest.mark.parametrize("fmt,margin", [("e4m3", 0), ("e5m2", 0), ("e4m3", 3)])
def test_scale_is_the_correctly_rounded_fp32_quotient(fresh_seed, fmt, margin):
    """fp8_max / (amax · 2^margin) rounded once to fp32 (float64 division then rounding is the correctly
    rounded fp32 quotient: 53 ≥ 2·24 + 2 bits); ``max * amax.reciprocal()`` misses it for about a quarter
    of amaxes, which this sample holds."""
    g = torch.Generator().manual_seed(fresh_seed)
    amax = torch.exp(torch.randn(4096, generator=g, dtype=torch.float64) * 8).float()
    want = (fp8_max(fmt) / (amax.double() * 2.0 ** margin)).float()
    got = scale_from_amax(amax, fmt, margin)
    assert torch.equal(got, want)
    assert int((amax.reciprocal() * (fp8_max(fmt) / 2.0 ** margin) != want).sum()) > 100


def test_nan_and_inf_are_refused_by_name():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight holds NaN or infinite values"):
            _state().cast(0, "w", torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match=r"fp8.recipe \('tensor'\) must be one of current, delayed, rowwise"):
        _state("tensor")
    with pytest.raises(ValueError, match=r"fp8.history \(0\) must be a positive integer"):
        _state("delayed", history=0)
    with pytest.raises(ValueError, match=r"fp8.amax_reduction \('mean'\)"):
        _state("delayed", reduction="mean")
    with pytest.raises(ValueError, match=r"fp8.margin \(-1\) must be an integer >= 0"):
        _state(margin=-1)
    with pytest.raises(ValueError, match=r"fp8 format \('e2m5'\)"):
        fp8_dtype("e2m5")


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_delayed_scaling_uses_the_history_of_previous_steps(reduction):
    """Every cast of a step (micro-batches, a recomputation) uses the scale of the previous steps' amaxes;
    the step's own amax is pushed once, at its end; a frozen pass and a state that records only in training
    steps leave the history as it was."""
    st = Fp8State(Fp8Recipe("delayed", history=3, reduction=reduction), ["lin"], guard=Fp8Guard(steps=1),
                  record_outside_steps=False)
    step_amaxes = [2.0, 8.0, 1.0, 4.0, 0.5, 0.25]
    used = []
    for step, a in enumerate(step_amaxes):
        with st.training_step():
            scales = [st.cast(0, "x", torch.tensor([a * f, -a / 3, 0.1]))[1] for f in (0.5, 1.0)]  # two micro-batches
            with fp8_frozen():  # a recomputation: the same scale, nothing recorded
                scales.append(st.cast(0, "x", torch.tensor([a * 100.0]))[1])
        st.cast(0, "x", torch.tensor([1e4]))  # outside the step (validation, a reference): not recorded either
        if step:  # the first step has no history: each cast takes its own amax
            assert scales[0] == scales[1] == scales[2]
        used.append(448.0 / float(scales[0]))
        st.end_step(step)
        assert float(st.history[0, 0, -1]) == a  # one push: the step's amax, not the frozen casts'
    want = [1.0]  # no history: the first micro-batch's own amax, max(a/2, a/3, 0.1) at a = 2
    for i in range(1, len(step_amaxes)):
        window = step_amaxes[max(0, i - 3):i]
        want.append(max(window) if reduction == "max" else window[-1])
    assert used == pytest.approx(want, rel=1e-6)
    assert int(st.book[0, 0]) == 3  # the window is full


def test_the_state_round_trips_through_its_checkpoint_tensors():
    st = Fp8State(Fp8Recipe("delayed", history=4), ["a", "b"])
    for name in ("a", "b"):
        st.slot(name)
    for step in range(3):
        for i in (0, 1):
            for role in ("x", "w", "dy"):
                st.cast(i, role, torch.randn(5, 16) * (step + 1 + i))
        st.end_step(step)
    st.disable("b", step=2)
    saved = {k: v.clone() for k, v in st.state_tensors().items()}
    assert sorted(saved) == ["fp8:a:amax_history", "fp8:a:book", "fp8:b:amax_history", "fp8:b:book", "fp8:run"]
    longer = _state("delayed", names=("b", "a", "c"), history=6)  # another order, another window, a new linear
    for name in ("a", "b", "c"):
        longer.slot(name)
    longer.load_state_tensors(saved)
    ia, ib = longer.index["a"], longer.index["b"]
    assert torch.equal(longer.history[ia, :, -4:], st.history[0]) and not longer.history[ia, :, :2].any()
    assert longer.enabled(ia) and not longer.enabled(ib) and longer.moved[0]["layer"] == "b"
    assert int(longer.book[ia, 0]) == 3 and not longer.history[longer.index["c"]].any()
    shorter = _state("delayed", names=("a",), history=2)
    shorter.slot("a")
    shorter.load_state_tensors(saved)
    assert torch.equal(shorter.history[0], st.history[0, :, -2:]) and int(shorter.book[0, 0]) == 2


def _tp_worker(rank, world, seed, recipe):
    from tpkernels.parallel.mappings import all_gather_dim

    g = torch.Generator().manual_seed(seed)
    full = torch.randn(8, 4 * world, generator=g) * torch.logspace(-2, 2, 4 * world)  # columns of very different size
    shard = full.chunk(world, dim=1)[rank].contiguous()
    q, scale = _state(recipe).cast(0, "x", shard, None, reduce_rows=True)
    whole = Fp8State(Fp8Recipe(recipe), ["lin"]).cast(0, "x", full, None)
    gathered = all_gather_dim(q.float().t().contiguous(), 0, None).t()
    torch.testing.assert_close(gathered, whole[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(scale, whole[1], rtol=0, atol=0)
    return float(scale.flatten()[0])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", ["current", "rowwise", "delayed"])
def test_tp_shards_share_the_whole_tensors_scale(rank_pool, fresh_seed, world, recipe):
    scales = rank_pool(world).run(_tp_worker, fresh_seed, recipe)
    assert len(set(scales)) == 1
