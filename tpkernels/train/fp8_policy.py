"""FP8 in the training job (``training.precision: fp8``): which linears run FP8, and the guardrail.

Choice (once, at start, the same on every rank): ``fp8.layers`` all / none / kinds run as told (a
kind whose per-rank shape FP8 GEMMs cannot take is refused by name); ``auto`` asks the planner's
GEMM model (:func:`tpkernels.planner.fp8_choice.fp8_layer_choices`: the GPU preset's FP8 and bf16
rates, or this machine's measured with ``fp8.measure``) for each kind of linear at this rank's
micro-batch tokens, and keeps FP8 where it predicts ≥ ``fp8.min_gain``. Rank 0 prints the table
(layer, shape, predicted gain, chosen) and the metrics file keeps it.

Guardrail (every step, at its end): each FP8 linear's casts count the values that saturate (beyond
the format's range) and the nonzero ones that underflow to 0, and the amax; one all-reduce over
the world sums them per linear (every rank decides alike). A linear over ``fp8.max_saturation`` or
``fp8.max_underflow`` for ``fp8.guard_steps`` consecutive steps moves back to bf16 before the next
step (exactly bf16 from then on), and the run says which, why and when; the move is kept in the
checkpoint's meta so a resume keeps it. Each step's record carries the worst linear's saturation
and underflow shares, the FP8 linears' count and their largest input amax (its trend).

Learning (``fp8.learn``): after the run's first step every rank times one linear of each kind, at
this run's micro-batch shape, forward and backward with its TP communication, in bf16 and in FP8
(detached copies of the weights and fresh FP8 states: training is untouched); the gains, averaged
over the ranks, are kept per machine (tpkernels.planner.fp8_choice.save_gains) and replace the
model's prediction for those shapes in every later ``auto`` choice on this machine, as the layout
planner keeps what autotune trials measured.
"""

from __future__ import annotations

import math

import torch

from tpkernels.functional.fp8_linear import Fp8Options
from tpkernels.models.attention import SelfAttention
from tpkernels.models.mlp import MLP
from tpkernels.parallel import control
from tpkernels.train.config import FP8_KINDS


def _linears(model) -> dict[str, tuple[str, torch.nn.Module]]:
    """'layers.<i>.<kind>' -> (kind, the TP linear) for this rank's decoder layers."""
    out = {}
    for m in model.modules():
        if isinstance(m, (SelfAttention, MLP)):
            for kind in FP8_KINDS:
                layer = getattr(m, kind, None)
                if isinstance(layer, torch.nn.Module):
                    out[f"layers.{m.layer}.{kind}"] = (kind, layer)
    return out


class Fp8Policy:
    """Built by the Trainer after the model (and its adapters): enables FP8 on the chosen linears."""

    def __init__(self, trainer):
        self.trainer = trainer
        f = trainer.cfg.fp8
        self.cfg, self.guard_steps = f, f.guard_steps
        self.options = Fp8Options(f.recipe, f.history, f.amax_reduction, f.grad_format, f.margin)
        self.mine = _linears(trainer.model)
        self.kinds_here = kinds_here = sorted({k for k, _ in self.mine.values()}, key=FP8_KINDS.index)
        self.learn_pending, self.learned = f.learn, None
        # every rank's linears in one order, for the guardrail's one all-reduce
        self.names = [f"layers.{i}.{k}" for i in range(trainer.mc.num_layers) for k in kinds_here]
        self.choices = None
        wanted = f.kinds()
        if wanted is None:
            wanted, self.choices = self._auto(trainer)
        unknown = [k for k in wanted if k not in kinds_here]
        if unknown and f.layers.strip().lower() != "all" and f.kinds() is not None:
            raise ValueError(f"fp8.layers ({f.layers!r}) names {unknown}: this model's linears are "
                             f"{', '.join(kinds_here)}")
        self.kinds = [k for k in kinds_here if k in wanted]
        for name, (kind, layer) in self.mine.items():
            if kind in self.kinds:
                try:
                    layer.enable_fp8(self.options).x.counting = self.guard_steps > 0
                except ValueError as e:
                    raise ValueError(f"fp8.layers ({f.layers!r}): {name}: {e}") from e
                for st in (layer.fp8.w, layer.fp8.dy):
                    st.counting = self.guard_steps > 0
        self.over = {n: 0 for n in self.names}
        self.moved: list[dict] = []
        self.last_amax: float | None = None

    def _auto(self, trainer):
        from tpkernels.planner.fp8_choice import fp8_layer_choices, load_gains, measure_fp8_rates  # noqa: PLC0415
        from tpkernels.planner.measure import preset_for_device  # noqa: PLC0415

        pc, dev = trainer.pc, trainer.device
        gpu = preset_for_device(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
        rates = measure_fp8_rates(dev) if self.cfg.measure else None
        if rates is not None:  # one verdict for every rank: the slowest rank's measurement
            bf16, fp8 = control.all_reduce_values([-rates.bf16_tflops, -rates.fp8_tflops], "max")
            rates = type(rates)(rates.device, -bf16, -fp8, rates.cast_gbs, rates.cast_op_s)
        tokens = pc.micro_batch_size * trainer.cfg.data.seq_length // pc.cp
        choices = fp8_layer_choices(trainer.mc, tp=pc.tp, sequence_parallel=pc.sequence_parallel, tokens=tokens,
                                    frozen=trainer.cfg.model.adapters, gpu=gpu, rates=rates,
                                    min_gain=self.cfg.min_gain, learned=load_gains(self.machine()),
                                    fp8_gather=self.options.recipe != "rowwise")
        return [c.name for c in choices if c.chosen], choices

    def machine(self) -> str:
        """The planner's key of this machine (its GPU preset or CPU, and the rank count)."""
        from tpkernels.planner.fit import machine_key  # noqa: PLC0415
        from tpkernels.planner.measure import preset_for_device  # noqa: PLC0415

        dev, ranks = self.trainer.device, self.trainer.pc.world_size
        if dev.type != "cuda":
            return machine_key("cpu", ranks)
        name = torch.cuda.get_device_name(dev)
        gpu = preset_for_device(name)
        return machine_key(gpu.name if gpu else name, ranks)

    def learn(self) -> dict[str, float]:
        """Time one linear of each kind in bf16 and in FP8 (module docstring); keep and return the gains
        by planner key. Collective: every rank, the same kinds in the same order."""
        import time  # noqa: PLC0415

        from tpkernels.functional.fp8_linear import (Fp8LinearState, fp8_column_parallel_linear,  # noqa: PLC0415
                                                     fp8_row_parallel_linear)
        from tpkernels.functional.tp_linear import column_parallel_linear, row_parallel_linear  # noqa: PLC0415
        from tpkernels.nn.tensor_parallel import ColumnParallelLinear  # noqa: PLC0415
        from tpkernels.planner.fp8_choice import gain_key, save_gains  # noqa: PLC0415

        tr, pc = self.trainer, self.trainer.pc
        first = {}
        for kind, layer in self.mine.values():
            first.setdefault(kind, layer)
        s = tr.cfg.data.seq_length // pc.cp
        sp = pc.sequence_parallel and pc.tp > 1
        keys, gains = [], []
        sync = torch.cuda.synchronize if tr.device.type == "cuda" else (lambda: None)
        for kind in self.kinds_here:
            layer = first[kind]
            column = isinstance(layer, ColumnParallelLinear)
            k, n = layer.weight.shape[1], layer.weight.shape[0]
            if k % 16 or n % 16 or layer.qweight is not None:
                continue
            frozen = not layer.weight.requires_grad
            shape = (pc.micro_batch_size, s // pc.tp if column and sp else s, k)
            x = torch.randn(shape, dtype=layer.weight.dtype, device=layer.weight.device)
            args = (layer.tp_group, layer.sequence_parallel, layer.sequence_dim, layer.algo)

            def step(fp8: bool, layer=layer, column=column, frozen=frozen, x=x, args=args):
                xi = x.detach().requires_grad_()
                w = layer.weight.detach().clone().requires_grad_(not frozen)
                if fp8:
                    st = Fp8LinearState(self.options, layer.tp_group, column)
                    for role in (st.x, st.w, st.dy):
                        role.counting = self.guard_steps > 0  # the counting the run pays for
                    fn = fp8_column_parallel_linear if column else fp8_row_parallel_linear
                    y = fn(xi, w, None, st, *args, layer.overlap_comm)
                elif column:
                    y = column_parallel_linear(xi, w, None, *args, False, layer.overlap_comm)
                else:
                    y = row_parallel_linear(xi, w, None, *args, layer.overlap_comm)
                y.backward(torch.ones_like(y))

            times = {}
            for fp8 in (False, True):
                step(fp8)  # warm-up
                sync()
                t0 = time.perf_counter()
                for _ in range(3):
                    step(fp8)
                sync()
                times[fp8] = (time.perf_counter() - t0) / 3
            keys.append(gain_key(pc.micro_batch_size * s, k, n, frozen, sp))
            gains.append(times[False] / times[True])
        gains = [g / pc.world_size for g in control.all_reduce_values(gains, "sum")]
        self.learned = dict(zip(keys, gains))
        if tr.state.rank == 0 and self.learned:
            save_gains(self.machine(), self.learned)
        return self.learned

    def table(self) -> str:
        from tpkernels.planner.fp8_choice import format_choices  # noqa: PLC0415

        head = (f"fp8 ({self.options.recipe}, gradients {self.options.grad_format}): FP8 linears "
                f"{', '.join(self.kinds) or 'none'}")
        return head + ("\n" + format_choices(self.choices) if self.choices is not None else "")

    def choice_record(self) -> dict:
        rows = [] if self.choices is None else [
            {"layer": c.name, "gemm": [c.m, c.k, c.n], "predicted_gain": None if math.isnan(c.gain) else c.gain,
             "chosen": c.chosen, "reason": c.reason} for c in self.choices]
        return {"fp8_choice": {"layers": self.cfg.layers, "recipe": self.options.recipe, "fp8": self.kinds,
                               "table": rows}}

    def restore(self, moved: list[dict]) -> None:
        """A resumed run: the linears its checkpoint's run moved back to bf16 stay there."""
        self.moved = list(moved)
        self.disable([m["layer"] for m in moved])

    def disable(self, names: list[str]) -> None:
        """Move ``names`` back to bf16."""
        for name in names:
            if name in self.mine and self.mine[name][1].fp8 is not None:
                self.mine[name][1].fp8.enabled = False
            self.over.pop(name, None)

    @property
    def disabled(self) -> list[str]:
        return [m["layer"] for m in self.moved]

    def after_step(self, step: int) -> tuple[dict, list[str]]:
        """Read and reset the casts' counts (one all-reduce); apply the guardrail. Returns the step record's
        fp8 fields and the messages of the linears moved back to bf16."""
        if self.learn_pending:
            self.learn_pending = False
            self.learn()
        if self.guard_steps == 0 or not self.kinds:
            return {}, []
        n = len(self.names)
        index = {name: i for i, name in enumerate(self.names)}
        dev = self.trainer.device
        counts = torch.zeros(3 * n, dtype=torch.float64, device=dev)  # numel, saturated, underflow per linear
        amax = torch.zeros(n, dtype=torch.float64, device=dev)
        for name, (kind, layer) in self.mine.items():
            if layer.fp8 is None or not layer.fp8.enabled:
                continue
            i = index[name]
            stats = layer.fp8.take_stats()
            for s in stats.values():  # device counters: no host read until the reduced vector
                counts[3 * i] += s.numel
                counts[3 * i + 1] += s.saturated
                counts[3 * i + 2] += s.underflow
            amax[i] = torch.as_tensor(stats["x"].amax, dtype=torch.float64, device=dev)
        counts = control.all_reduce_(counts, "sum").tolist()  # the step's one host read of the counts
        amax = control.all_reduce_(amax, "max").tolist()
        bad_amax = [self.names[i] for i, a in enumerate(amax) if not math.isfinite(a)]
        if bad_amax:
            raise FloatingPointError(f"fp8: the input of {', '.join(bad_amax[:4])} held NaN or inf at step {step}; "
                                     "lower optimizer.lr or enable optimizer.clip_grad")
        messages, worst_sat, worst_under = [], 0.0, 0.0
        for i, name in enumerate(self.names):
            numel = counts[3 * i]
            if name not in self.over or numel == 0:
                continue
            sat, under = counts[3 * i + 1] / numel, counts[3 * i + 2] / numel
            worst_sat, worst_under = max(worst_sat, sat), max(worst_under, under)
            over = sat > self.cfg.max_saturation or under > self.cfg.max_underflow
            self.over[name] = self.over[name] + 1 if over else 0
            if self.over[name] >= self.guard_steps:
                why = (f"{100 * sat:.3g}% of its cast values saturated (fp8.max_saturation "
                       f"{100 * self.cfg.max_saturation:.3g}%)" if sat > self.cfg.max_saturation else
                       f"{100 * under:.3g}% of its nonzero cast values underflowed to 0 (fp8.max_underflow "
                       f"{100 * self.cfg.max_underflow:.3g}%)")
                self.moved.append({"layer": name, "step": step, "saturated": sat, "underflow": under})
                self.disable([name])
                messages.append(f"fp8 guardrail: {name} moves back to bf16 after step {step}: {why} for "
                                f"{self.guard_steps} steps in a row")
        top = max(amax) if amax else 0.0
        chosen = sum(1 for name in self.names if name.rsplit(".", 1)[1] in self.kinds)
        rec = {"fp8/linears": chosen - len(self.moved),
               "fp8/saturated": worst_sat, "fp8/underflow": worst_under, "fp8/amax": top,
               "fp8/amax_trend": top / self.last_amax if self.last_amax else 1.0}
        self.last_amax = top
        return rec, messages


__all__ = ["Fp8Policy"]
