"""The FP8 run state of a model's linears and its one owner, :class:`Fp8State`.

    state = Fp8State(Fp8Recipe("delayed", history=16), ["layers.0.qkv", "layers.0.down"], device)
    layer.enable_fp8(state=state, name="layers.0.qkv")   # the layer casts through state.slot(name, tp_group)
    with state.training_step():                           # casts record amaxes and counts only inside a step
        loss = model(batch); loss.backward()
    record, moved = state.end_step(step)                  # one reduction: histories pushed, guardrail applied
    tensors = state.state_tensors()                       # into the checkpoint, keyed by linear name

What it owns, for every FP8 linear (three tensor roles each: the input x, the weight w, the output
gradient dy): the delayed recipe's amax history, the running amax and cast counts of the step in
progress, the guardrail's streak of bad steps, and whether (and when, why) the guardrail moved the
linear back to bf16. Nothing else holds FP8 state; the rules of the house for run state hold here:

(a) saved and restored with the checkpoint (:meth:`state_tensors`, :meth:`load_state_tensors`),
    keyed by the linear's name (``layers.<i>.<kind>``, global layer index), so it reshards across TP,
    PP, DP and CP like the weights: the values are the same on every rank that holds the linear (see
    (c)), whatever the layout;
(b) frozen in every pass that is not a training step: with ``record_outside_steps=False`` (the
    trainer's) casts record only inside :meth:`training_step`; :func:`fp8_frozen` stops recording
    everywhere (a recomputed forward in backward: it reads the same history, so it casts with the
    forward's scales and the weight gradient reads the x8 the forward used);
(c) agreed across ranks: the step's amaxes are MAX-reduced and its counts summed over the world once, at
    :meth:`end_step`, and every rank pushes the same history and takes the same guardrail decision.

Recipes (where a tensorwise cast's amax comes from):
  current   this tensor's amax, MAX-reduced over the linear's TP group (its shards share one scale).
  delayed   the reduction (``max`` or ``most_recent``) of the last ``history`` *steps'* amaxes of this
            role (one push per step, at its end, as TransformerEngine's delayed scaling updates once per
            step); a role with no history yet casts with its current amax. Every micro-batch and a
            recomputation of one step use the same scale.
  rowwise   one scale per row from each row's amax (torchao's rowwise recipe), reduced over the TP
            group where a row's elements are split over it.
``margin`` (powers of two of headroom) applies to every cast of every recipe.

Guardrail (``Fp8Guard``): a linear whose casts saturate more than ``max_saturation`` or underflow more
than ``max_underflow`` (shares of its values, summed over the roles and the world) for ``steps``
consecutive steps moves back to bf16 from the next step on.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from tpkernels._state import setting
from tpkernels.parallel import control
from tpkernels.quant.fp8 import cast_counts, cast_to_fp8, check_finite, fp8_dtype, scale_from_amax

RECIPES = ("current", "delayed", "rowwise")
REDUCTIONS = ("max", "most_recent")
GRAD_FORMATS = ("e5m2", "e4m3")
ROLES = ("x", "w", "dy")
ROLE_NAMES = {"x": "input", "w": "weight", "dy": "output gradient"}
# a linear's book: steps of history per role, then the guardrail's streak, the step it moved at (-1: not moved)
# and the shares that moved it
_FILLED, _STREAK, _MOVED, _SAT, _UNDER = 0, 3, 4, 5, 6
_BOOK = 7
_TLS = threading.local()


@dataclass(frozen=True)
class Fp8Recipe:
    """recipe: current | delayed | rowwise; history / reduction: delayed's window of steps and its
    reduction (max | most_recent); grad_format: the output gradient's (e5m2, or e4m3 with its scale);
    margin: powers of two of headroom below the format's max."""

    recipe: str = "current"
    history: int = 16
    reduction: str = "max"
    grad_format: str = "e5m2"
    margin: int = 0

    def check(self) -> "Fp8Recipe":
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8.recipe ({self.recipe!r}) must be one of {', '.join(RECIPES)}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"fp8.amax_reduction ({self.reduction!r}) must be one of {', '.join(REDUCTIONS)}")
        if not isinstance(self.history, int) or isinstance(self.history, bool) or self.history < 1:
            raise ValueError(f"fp8.history ({self.history!r}) must be a positive integer")
        if self.grad_format not in GRAD_FORMATS:
            raise ValueError(f"fp8.grad_format ({self.grad_format!r}) must be one of {', '.join(GRAD_FORMATS)}")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"fp8.margin ({self.margin!r}) must be an integer >= 0")
        return self

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    def fmt(self, role: str) -> str:
        return self.grad_format if role == "dy" else "e4m3"


@dataclass(frozen=True)
class Fp8Guard:
    """The guardrail's thresholds; ``steps`` 0 turns it (and the cast counting it reads) off."""

    max_saturation: float = 1e-3
    max_underflow: float = 0.25
    steps: int = 0


@contextmanager
def fp8_frozen(frozen: bool = True):
    """No FP8 cast inside the block records an amax or a count, whatever state it belongs to."""
    with setting(_TLS, "frozen", frozen):
        yield


class Fp8State:
    """The FP8 state of the linears ``names`` (every rank lists the model's FP8 linears in one order).

    device: where the histories and the step's amaxes and counts live (the model's); reduce_group:
    the ranks :meth:`end_step` reduces over (None: the world); record_outside_steps: casts outside
    :meth:`training_step` record too (a standalone layer's state; the trainer's records only in steps)."""

    def __init__(self, recipe: Fp8Recipe, names: list[str], device=None, *, guard: Fp8Guard = Fp8Guard(),
                 reduce_group=None, record_outside_steps: bool = True):
        self.recipe, self.guard = recipe.check(), guard
        if len(set(names)) != len(names):
            raise ValueError(f"Fp8State: linear names must be unique, got {names}")
        self.names = list(names)
        self.index = {n: i for i, n in enumerate(names)}
        n, dev = len(names), torch.device(device) if device is not None else torch.device("cpu")
        self.history = torch.zeros(n, 3, recipe.history, dtype=torch.float32, device=dev)
        self.step_amax = torch.zeros(n, 3, dtype=torch.float32, device=dev)
        self.counts = torch.zeros(n, 3, 3, dtype=torch.float64, device=dev)  # role × (numel, saturated, underflow)
        self.book = torch.zeros(n, _BOOK, dtype=torch.float64)
        self.book[:, _MOVED] = -1
        self.run = torch.zeros(2, dtype=torch.float64)  # steps closed, the last step's largest input amax
        self.reduce_group, self.record_outside_steps = reduce_group, record_outside_steps
        self.local: dict[str, int] = {}  # the linears this rank holds (a slot was taken)
        self._in_step = False

    # ---- what a linear casts through ----
    def slot(self, name: str, group=None, column: bool = True) -> "Fp8Slot":
        """The linear ``name``'s handle: ``group`` its TP group, ``column`` its parallel style."""
        if name not in self.index:
            raise ValueError(f"fp8: linear {name!r} is not one of this state's linears ({', '.join(self.names)})")
        self.local[name] = self.index[name]
        return Fp8Slot(self, self.index[name], name, group, column)

    @property
    def recording(self) -> bool:
        return not getattr(_TLS, "frozen", False) and (self._in_step or self.record_outside_steps)

    @contextmanager
    def training_step(self):
        """Casts inside the block are a training step's: they record amaxes and counts."""
        prev, self._in_step = self._in_step, True
        try:
            yield
        finally:
            self._in_step = prev

    def enabled(self, i: int) -> bool:
        return bool(self.book[i, _MOVED] < 0)

    def _scale(self, i: int, r: int, t: Tensor, group, reduce_rows: bool) -> tuple[Tensor, Tensor]:
        """(the scale of this cast of ``t``, ``t``'s amax on this rank) for role ``r`` of linear ``i``."""
        fmt, margin = self.recipe.fmt(ROLES[r]), self.recipe.margin
        a = t.detach().abs().float()
        if self.recipe.rowwise:
            rows = a.reshape(-1, t.shape[-1]).amax(1, keepdim=True)
            if reduce_rows:
                _agree_amax(rows, group)
            return scale_from_amax(rows, fmt, margin), rows.amax() if rows.numel() else rows.new_zeros(())
        amax = a.amax() if a.numel() else a.new_zeros(())
        filled = int(self.book[i, _FILLED + r])
        if self.recipe.recipe == "delayed" and filled:
            past = self.history[i, r, -filled:]
            use = past.max() if self.recipe.reduction == "max" else past[-1]
        else:
            use = _agree_amax(amax.clone(), group)
        return scale_from_amax(use, fmt, margin), amax

    def cast(self, i: int, role: str, t: Tensor, group=None, *, reduce_rows: bool = False,
             name: str | None = None) -> tuple[Tensor, Tensor]:
        """(FP8 ``t``, its scale) for ``role`` of linear ``i``: a scalar scale, or (rows, 1) over
        ``t.reshape(-1, K)``'s rows for the rowwise recipe (then the result has that 2-D shape)."""
        check_finite(t, name or ROLE_NAMES[role])
        r = ROLES.index(role)
        fmt = self.recipe.fmt(role)
        scale, amax = self._scale(i, r, t, group, reduce_rows)
        src = t.reshape(-1, t.shape[-1]) if self.recipe.rowwise else t
        q = cast_to_fp8(src, scale, fmt)
        if self.recording:
            self.step_amax[i, r] = torch.maximum(self.step_amax[i, r], amax)
            self.counts[i, r, 0] += t.numel()
            if self.guard.steps:  # two more passes over t: only when the guardrail reads them
                self.counts[i, r, 1:] += cast_counts(src, scale, q, fmt)
        return q, scale

    # ---- the step boundary ----
    def end_step(self, step: int) -> tuple[dict, list[str]]:
        """Close a training step (collective over ``reduce_group``): reduce the step's amaxes (max) and
        counts (sum) once, push the amaxes into the histories, apply the guardrail. Returns the step
        record's fp8 fields and the messages of the linears moved back to bf16."""
        n = len(self.names)
        if n == 0:
            return {}, []
        amax = control.all_reduce_(self.step_amax.clone(), "max", self.reduce_group)
        counts = control.all_reduce_(self.counts.clone(), "sum", self.reduce_group).cpu()  # the one host read
        self.step_amax.zero_()
        self.counts.zero_()
        if not torch.isfinite(amax).all():
            bad = [self.names[i] for i in range(n) if not bool(torch.isfinite(amax[i]).all())]
            raise FloatingPointError(f"fp8: the casts of {', '.join(bad[:4])} held NaN or inf at step {step}; lower "
                                     "optimizer.lr or enable optimizer.clip_grad")
        seen = counts[:, :, 0] > 0  # (n, 3): roles cast this step
        if bool(seen.any()):
            pushed = torch.cat([self.history[:, :, 1:], amax[:, :, None]], dim=2)
            self.history.copy_(torch.where(seen.to(self.history.device)[:, :, None], pushed, self.history))
            filled = self.book[:, _FILLED:_FILLED + 3]
            filled.copy_(torch.where(seen, (filled + 1).clamp(max=self.recipe.history), filled))
        messages, worst_sat, worst_under = self._guardrail(step, counts)
        top = float(amax[:, 0].max())
        last = float(self.run[1])
        self.run[0] += 1
        self.run[1] = top
        rec = {"fp8/linears": sum(self.enabled(i) for i in range(n))}
        if self.guard.steps:
            rec.update({"fp8/saturated": worst_sat, "fp8/underflow": worst_under, "fp8/amax": top,
                        "fp8/amax_trend": top / last if last else 1.0})
        return rec, messages

    def _guardrail(self, step: int, counts: Tensor) -> tuple[list[str], float, float]:
        g = self.guard
        messages, worst_sat, worst_under = [], 0.0, 0.0
        if not g.steps:
            return messages, worst_sat, worst_under
        total = counts.sum(1)  # (n, 3): numel, saturated, underflow over the roles
        for i, name in enumerate(self.names):
            numel = float(total[i, 0])
            if not self.enabled(i) or numel == 0:
                continue
            sat, under = float(total[i, 1]) / numel, float(total[i, 2]) / numel
            worst_sat, worst_under = max(worst_sat, sat), max(worst_under, under)
            bad = sat > g.max_saturation or under > g.max_underflow
            self.book[i, _STREAK] = self.book[i, _STREAK] + 1 if bad else 0
            if self.book[i, _STREAK] >= g.steps:
                self.book[i, _MOVED], self.book[i, _SAT], self.book[i, _UNDER] = step, sat, under
                why = (f"{100 * sat:.3g}% of its cast values saturated (fp8.max_saturation {100 * g.max_saturation:.3g}%)"
                       if sat > g.max_saturation else
                       f"{100 * under:.3g}% of its nonzero cast values underflowed to 0 (fp8.max_underflow "
                       f"{100 * g.max_underflow:.3g}%)")
                messages.append(f"fp8 guardrail: {name} moves back to bf16 after step {step}: {why} for {g.steps} "
                                "steps in a row")
        return messages, worst_sat, worst_under

    @property
    def moved(self) -> list[dict]:
        """The linears the guardrail moved back to bf16: name, step, the shares that moved them."""
        return [{"layer": n, "step": int(self.book[i, _MOVED]), "saturated": float(self.book[i, _SAT]),
                 "underflow": float(self.book[i, _UNDER])} for i, n in enumerate(self.names) if not self.enabled(i)]

    def disable(self, name: str, step: int = 0) -> None:
        """Move ``name`` back to bf16 (as the guardrail does) from now on."""
        i = self.index[name]
        if self.enabled(i):
            self.book[i, _MOVED] = step

    # ---- checkpoints ----
    def state_tensors(self) -> dict[str, Tensor]:
        """This rank's linears' state as checkpoint tensors, keyed by linear name (the same values on every
        rank that holds the linear: DCP keeps one copy)."""
        out = {"fp8:run": self.run}
        for name, i in sorted(self.local.items()):
            out[f"fp8:{name}:amax_history"] = self.history[i]
            out[f"fp8:{name}:book"] = self.book[i]
        return out

    def load_state_tensors(self, found: dict[str, Tensor]) -> None:
        """Restore from a checkpoint's tensors (``found``: key -> its stored tensor, for the keys of
        :meth:`state_tensors` it holds). A linear the checkpoint lacks starts fresh; a history saved with
        another ``fp8.history`` keeps its newest steps."""
        if "fp8:run" in found:
            self.run.copy_(found["fp8:run"].to(self.run.dtype))
        for name, i in self.local.items():
            hist, book = found.get(f"fp8:{name}:amax_history"), found.get(f"fp8:{name}:book")
            if hist is None or book is None:
                continue
            keep = min(hist.shape[-1], self.recipe.history)
            self.history[i].zero_()
            if keep:
                self.history[i, :, -keep:] = hist[:, -keep:].to(self.history.device, self.history.dtype)
            self.book[i] = book.to(self.book.dtype)
            self.book[i, _FILLED:_FILLED + 3].clamp_(max=keep)


def _agree_amax(amax: Tensor, group) -> Tensor:
    """``amax`` MAX-reduced in place over the TP ``group`` (a device tensor: the data plane); a tuple of
    groups is reduced over each in turn (a MoE layer's experts: their TP group, then their EP group)."""
    for g in group if isinstance(group, tuple) else (group,):
        if control.group_size(g) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g)
    return amax


class Fp8Slot:
    """One linear's view of its :class:`Fp8State`: its index, its TP group and parallel style."""

    __slots__ = ("state", "i", "name", "group", "column")

    def __init__(self, state: Fp8State, i: int, name: str, group, column: bool):
        self.state, self.i, self.name, self.group, self.column = state, i, name, group, column

    @property
    def enabled(self) -> bool:
        return self.state.enabled(self.i)

    @property
    def recipe(self) -> Fp8Recipe:
        return self.state.recipe

    def cast(self, role: str, t: Tensor, *, reduce_rows: bool = False) -> tuple[Tensor, Tensor]:
        """(FP8 ``t``, its scale) with the TP group's agreement (see :meth:`Fp8State.cast`)."""
        return self.state.cast(self.i, role, t, self.group, reduce_rows=reduce_rows)

    def fmt(self, role: str) -> str:
        return self.state.recipe.fmt(role)

    def dtype(self, role: str) -> torch.dtype:
        return fp8_dtype(self.fmt(role))


__all__ = ["Fp8Guard", "Fp8Recipe", "Fp8Slot", "Fp8State", "GRAD_FORMATS", "RECIPES", "REDUCTIONS", "ROLES",
           "fp8_frozen"]
