"""The one TP linear over every weight format: dense, NF4, int8 and FP8 (current, delayed, rowwise with a
margin) × {column, row} × {SP, no SP} × {ring, collective} × TP 1–4, receive buffers poisoned with NaN:
output, input gradient, weight and bias gradients against a float64 oracle of the format's own
operands, built here from the whole tensors:

* dense (float64): the float64 GEMMs of the same weights (roundoff only);
* NF4 / int8 (float64 activations, a frozen base): the float64 GEMMs of the dequantised shards,
  gathered (each rank quantises its own shard, a fused shard as several pieces); no weight gradient,
  and nothing of the input is kept for the backward;
* FP8 (bf16 activations and weights): float64 GEMMs of the FP8-rounded whole tensors (tensorwise: one
  scale per tensor; delayed: the scales of the previous step's amaxes, reduced over the ranks;
  rowwise: each GEMM's operands along their rows, every cast with the margin). Each output is the
  exact product rounded once to bf16: within half a bf16 ulp plus fp32 roundoff of the largest
  value, which a partial sum rounded to bf16 on its rank before the reduction exceeds.
A frozen dense or FP8 weight keeps nothing of its input either."""

from __future__ import annotations

import pytest
import torch

from tpkernels.functional.gemm_comm import poison_receive_buffers
from tpkernels.nn import ColumnParallelLinear, RowParallelLinear
from tpkernels.parallel.mappings import all_gather_dim
from tpkernels.quant.fp8 import cast_to_fp8, fp8_max
from tpkernels.quant.fp8_state import Fp8Recipe

from test_tp_layers import _forced_algo, _shard

WORLD_SIZES = [1, 2, 3, 4]
FORMATS = ["dense", "nf4", "int8", "fp8-current", "fp8-delayed", "fp8-rowwise"]


def _fp8_scale(amax: torch.Tensor, fmt: str, margin: int) -> torch.Tensor:
    """The oracle's scale: fp8_max / (amax · 2^margin) divided in float64 and rounded to fp32 once (the
    correctly rounded fp32 quotient); amax 0: 1."""
    s = (fp8_max(fmt) / (amax.double() * 2.0 ** margin)).float()
    return torch.where(amax > 0, s, torch.ones_like(s))


def _q(t: torch.Tensor, fmt: str, rowwise: bool, margin: int = 0, amax=None) -> torch.Tensor:
    """The FP8 rounding of the whole 2-D ``t`` (rowwise: along its rows; else at ``amax`` or its own), in float64."""
    if amax is None:
        amax = t.abs().amax(1, keepdim=True) if rowwise else t.abs().amax()
    scale = _fp8_scale(amax, fmt, margin)
    return cast_to_fp8(t, scale, fmt).double() / scale.double()


def _rows2(t):
    return t.reshape(-1, t.shape[-1])


class Oracle:
    """The format's float64 products of whole tensors: y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x (2-D)."""

    def __init__(self, fmt: str, w: torch.Tensor, margin: int = 0, amaxes: dict | None = None):
        self.fmt, self.w, self.margin, self.amaxes = fmt, w.double(), margin, amaxes or {}

    def __call__(self, x2: torch.Tensor, dy2: torch.Tensor):
        x2, dy2, w = x2.double(), dy2.double(), self.w
        if not self.fmt.startswith("fp8"):
            return x2 @ w.t(), dy2 @ w, dy2.t() @ x2
        rowwise, m, a = self.fmt == "fp8-rowwise", self.margin, self.amaxes
        if rowwise:
            y = _q(x2, "e4m3", True, m) @ _q(w, "e4m3", True, m).t()
            dx = _q(dy2, "e5m2", True, m) @ _q(w.t().contiguous(), "e4m3", True, m).t()
            dw = _q(dy2.t().contiguous(), "e5m2", True, m) @ _q(x2.t().contiguous(), "e4m3", True, m).t()
            return y, dx, dw
        qx, qw = _q(x2, "e4m3", False, amax=a.get("x")), _q(w, "e4m3", False, amax=a.get("w"))
        qdy = _q(dy2, "e5m2", False, amax=a.get("dy"))
        return qx @ qw.t(), qdy @ qw, qdy.t() @ qx


def _assert_close(got: torch.Tensor, want: torch.Tensor, fmt: str, name: str) -> None:
    if fmt.startswith("fp8"):  # the exact product rounded once to bf16, plus fp32 roundoff
        got64, bound = got.double(), 2.0 ** -8 * want.abs() + 2.0 ** -16 * float(want.abs().max())
        worst = float(((got64 - want).abs() - bound).max())
        assert worst <= 0, f"{fmt} {name}: off by {worst:.3g} beyond half a bf16 ulp (+ fp32 roundoff)"
        return
    torch.testing.assert_close(got.double(), want, rtol=1e-10, atol=1e-11, msg=f"{fmt} {name}")


def _layer(fmt: str, column: bool, sp: bool, rank: int, world: int, w_full: torch.Tensor, bias_full, dtype):
    """This rank's layer of ``fmt`` holding its shard of ``w_full``; returns (layer, the oracle's weight)."""
    out, inp = w_full.shape
    quant = fmt if fmt in ("nf4", "int8") else None
    cls, kw = (ColumnParallelLinear, {}) if column else (RowParallelLinear, {})
    layer = cls(inp, out, bias_full is not None, None, sequence_parallel=sp, sequence_dim=1, dtype=dtype,
                quant=quant, **kw)
    if column:
        mine = slice(rank * layer.out_per_rank, (rank + 1) * layer.out_per_rank)
        shard = w_full[mine]
    else:
        mine = slice(rank * layer.in_per_rank, (rank + 1) * layer.in_per_rank)
        shard = w_full[:, mine]
    if quant:
        splits = [5, shard.shape[0] - 5] if column else None  # a fused shard: two pieces, each quantised alone
        layer.load_quantized_(shard.contiguous(), splits)
        deq = layer.qweight.dequantize().to(torch.float64)
        w_ref = all_gather_dim(deq.contiguous(), 0, None) if column else \
            all_gather_dim(deq.t().contiguous(), 0, None).t()
    else:
        with torch.no_grad():
            layer.weight.copy_(shard)
        w_ref = w_full
    if bias_full is not None:
        with torch.no_grad():
            layer.bias.copy_(bias_full[mine] if column else bias_full)
    if fmt.startswith("fp8"):
        layer.enable_fp8(Fp8Recipe(fmt.split("-")[1], margin=1 if fmt == "fp8-rowwise" else 0))
    return layer, w_ref, mine


def _saved_shapes(fn):
    """Run ``fn`` and return the shapes of every tensor autograd saved for its backward."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def _check(rank, world, gen, fmt, column, sp, algo, frozen):
    fp8 = fmt.startswith("fp8")
    dtype = torch.bfloat16 if fp8 else torch.float64
    inner, per = (32, 16) if fp8 else (23, 17)  # FP8 GEMMs take 16-multiples; odd shards elsewhere
    b, s = 2, 3 * world
    out, inp = (per * world, inner) if column else (inner, per * world)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).double()

    w_full = rnd(out, inp)
    bias_full = None if fp8 else rnd(out)  # FP8: no bias (its add would round y a second time; the bias path is shared)
    layer, w_ref, mine = _layer(fmt, column, sp, rank, world, w_full, bias_full, dtype)
    if frozen:
        layer.weight.requires_grad_(False)
    steps = [(rnd(b, s, inp, scale=3.0), rnd(b, s, out, scale=1 / 7))]
    if fmt == "fp8-delayed":  # step 2 casts with step 1's amaxes (reduced over the ranks), partly saturating
        steps.append(tuple((t * f).to(dtype).double() for t, f in zip(steps[0], (1.5, 0.75))))
    amaxes = {}
    for step, (x, dy) in enumerate(steps):
        if step:
            layer.fp8.state.end_step(step - 1)
            amaxes = {"x": steps[0][0].abs().amax(), "w": w_full.abs().amax(), "dy": steps[0][1].abs().amax()}
        y_ref, dx_ref, dw_ref = Oracle(fmt, w_ref, 1 if fmt == "fp8-rowwise" else 0, amaxes)(_rows2(x), _rows2(dy))
        y_ref, dx_ref = y_ref.view(b, s, -1), dx_ref.view(b, s, -1)
        if bias_full is not None:
            y_ref = y_ref + bias_full
        xin = (_shard(x, 1, rank, world) if sp else x) if column else x[..., mine]
        xin = xin.to(dtype).clone().requires_grad_()
        dyin = dy[..., mine] if column else (_shard(dy, 1, rank, world) if sp else dy)
        layer.zero_grad(set_to_none=True)
        with poison_receive_buffers(), _forced_algo(algo):
            y, saved = _saved_shapes(lambda: layer(xin))
            y.backward(dyin.to(dtype).contiguous())
        tag = f"{'column' if column else 'row'} sp={sp} {algo} frozen={frozen} step {step}"
        want_y = y_ref[..., mine] if column else (_shard(y_ref, 1, rank, world) if sp else y_ref)
        want_dx = (_shard(dx_ref, 1, rank, world) if sp else dx_ref) if column else dx_ref[..., mine]
        _assert_close(y, want_y, fmt, f"y ({tag})")
        _assert_close(xin.grad, want_dx, fmt, f"dx ({tag})")
        trainable = not frozen and fmt not in ("nf4", "int8")
        if trainable:
            _assert_close(layer.weight.grad, dw_ref[mine] if column else dw_ref[:, mine], fmt, f"dW ({tag})")
        else:  # a frozen or quantised weight keeps nothing of its input (neither x nor its gathered form)
            assert layer.weight.grad is None
            x_shapes = {tuple(xin.shape), (b, s, xin.shape[-1])}
            assert not x_shapes & set(saved), f"{fmt} ({tag}) kept its input: saved {saved}"
        if bias_full is not None:
            want_db = dy[..., mine].sum((0, 1)) if column else dy.sum((0, 1))
            _assert_close(layer.bias.grad, want_db, fmt, f"db ({tag})")


def _worker(rank, world, seed, fmt):
    gen = torch.Generator().manual_seed(seed)  # the same data on every rank
    for column in (True, False):
        for sp in (False, True):
            for algo in ("ring", "collective"):
                _check(rank, world, gen, fmt, column, sp, algo, frozen=False)
        if fmt in ("dense", "fp8-current"):
            _check(rank, world, gen, fmt, column, True, "ring", frozen=True)
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_weight_format_runs_the_one_tp_schedule(rank_pool, fresh_seed, world, fmt):
    assert rank_pool(world).run(_worker, fresh_seed, fmt) == [True] * world


def test_fused_gemm_comm_is_refused_for_a_quantised_or_fp8_weight():
    from tpkernels.functional.gemm_comm import choose_algo

    with pytest.raises(Exception, match="quantised .*or FP8 weight runs the ring or collective"):
        choose_algo("all_gather_matmul", "fused", 2, 1e12, torch.device("cpu"), quantized=True)
    with pytest.raises(ValueError, match=r"algo \('fused'\) reads a 16-bit weight tensor"):
        ColumnParallelLinear(64, 64, quant="nf4", algo="fused")
