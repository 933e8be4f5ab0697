"""FP8 in the training job (``training.precision: fp8``): which linears run FP8, and learning their gains.

Choice (once, at start, decided on rank 0 and broadcast, so every rank enables the same linears and
their collectives match): ``fp8.layers`` all / none / kinds run as told (a kind whose per-rank shape
FP8 GEMMs cannot take is refused by name); ``auto`` asks the planner's GEMM model
(:func:`tpkernels.planner.fp8_choice.fp8_layer_choices`: the GPU preset's FP8 and bf16 rates, or this
machine's measured with ``fp8.measure``, or gains an earlier run learned on this machine) for each kind
of linear at this rank's micro-batch tokens, and keeps FP8 where it predicts ≥ ``fp8.min_gain``.
Rank 0 prints the table (layer, shape, predicted gain, chosen) and the metrics file keeps it.

State: the chosen linears' FP8 state (the delayed recipe's histories, the step's amaxes and cast counts,
the guardrail's streaks and moves) has one owner, the model's :class:`tpkernels.quant.fp8_state.Fp8State`
(``policy.state``): it records casts only inside the trainer's training steps, closes each step with one
reduction (``after_step``), and is saved and restored with the checkpoint (the trainer passes it as run
state), so a resumed run keeps its histories, streaks and the linears moved back to bf16, and says so.

Learning (``fp8.learn``): after the run's first step every rank times one linear of each kind, at
this run's micro-batch shape, forward and backward with its TP communication, in bf16 and in FP8
(detached copies of the weights, an FP8 state of the timing's own, inputs from a generator of its own:
training is untouched); the gains, averaged over the ranks, are kept per machine by kind and
communication (tpkernels.planner.fp8_choice.save_gains, written by rank 0) and replace the model's
prediction for those linears in every later ``auto`` choice on this machine, as the layout planner
keeps what autotune trials measured.
"""

from __future__ import annotations

import math

import torch

from tpkernels.functional.fp8_format import Fp8Format
from tpkernels.functional.tp_linear import column_parallel_linear, row_parallel_linear
from tpkernels.models.attention import SelfAttention
from tpkernels.models.mlp import MLP
from tpkernels.models.moe import MoE
from tpkernels.nn.tensor_parallel import ColumnParallelLinear
from tpkernels.parallel import control
from tpkernels.quant.fp8_state import Fp8Guard, Fp8Recipe, Fp8State
from tpkernels.train.config import FP8_KINDS


def _linears(model) -> dict[str, tuple[str, torch.nn.Module]]:
    """'layers.<i>.<kind>' -> (kind, the TP linear) for this rank's decoder layers; a MoE layer's routed
    experts are kind ``experts``, two FP8 linears 'layers.<i>.experts.gate_up' / '.down' (-> the MoE)."""
    out = {}
    for m in model.modules():
        if isinstance(m, MoE):
            for name in m.fp8_names().values():
                out[name] = ("experts", m)
        elif isinstance(m, (SelfAttention, MLP)):
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
        self.cfg = f
        self.recipe = Fp8Recipe(f.recipe, f.history, f.amax_reduction, f.grad_format, f.margin).check()
        self.guard = Fp8Guard(f.max_saturation, f.max_underflow, f.guard_steps)
        self.mine = _linears(trainer.model)
        self.kinds_here = kinds_here = sorted({k for k, _ in self.mine.values()}, key=FP8_KINDS.index)
        self.learn_pending, self.learned = f.learn, None
        self.choices = None
        wanted = f.kinds()
        if wanted is None:
            wanted, self.choices = self._auto(trainer)
        unknown = [k for k in wanted if k not in kinds_here]
        if unknown and f.layers.strip().lower() != "all" and f.kinds() is not None:
            raise ValueError(f"fp8.layers ({f.layers!r}) names {unknown}: this model's linears are "
                             f"{', '.join(kinds_here)}")
        self.kinds = [k for k in kinds_here if k in wanted]
        # every rank lists the model's FP8 linears in one order: the step's one reduction is over all of them
        mc = trainer.mc
        names = []
        for i in range(mc.num_layers):
            for k in self.kinds:
                if k != "experts":
                    names.append(f"layers.{i}.{k}")
                elif mc.is_moe_layer(i):
                    names += [f"layers.{i}.experts.{m}" for m in MoE.FP8_MATRICES.values()]
        if self.recipe.rowwise and "experts" in self.kinds:
            raise ValueError(f"fp8.recipe rowwise with fp8.layers ({f.layers!r}) taking the routed experts: their "
                             "grouped GEMMs run tensorwise (delayed or current); use fp8.recipe delayed, or leave "
                             "the experts bf16 (fp8.layers without experts)")
        self.state = Fp8State(self.recipe, names, trainer.device, guard=self.guard, record_outside_steps=False)
        for name, (kind, layer) in self.mine.items():
            if kind in self.kinds:
                try:
                    if kind == "experts":
                        layer.enable_fp8(self.state, [name])
                    else:
                        layer.enable_fp8(state=self.state, name=name)
                except ValueError as e:
                    raise ValueError(f"fp8.layers ({f.layers!r}): {name}: {e}") from e

    def _auto(self, trainer):
        from tpkernels.planner.fp8_choice import fp8_layer_choices, load_gains, measure_fp8_rates  # noqa: PLC0415
        from tpkernels.planner.measure import preset_for_device  # noqa: PLC0415

        pc, dev = trainer.pc, trainer.device
        rates = measure_fp8_rates(dev) if self.cfg.measure else None
        if rates is not None:  # one verdict: the slowest rank's measurement
            bf16, fp8 = control.all_reduce_values([-rates.bf16_tflops, -rates.fp8_tflops], "max")
            rates = type(rates)(rates.device, -bf16, -fp8, rates.cast_gbs, rates.cast_op_s)
        choices = None
        if trainer.state.rank == 0:  # rank 0 reads its gains file and decides; every rank enables what it chose
            gpu = preset_for_device(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
            tokens = pc.micro_batch_size * trainer.cfg.data.seq_length // pc.cp
            choices = fp8_layer_choices(trainer.mc, tp=pc.tp, sequence_parallel=pc.sequence_parallel, tokens=tokens,
                                        frozen=trainer.cfg.model.adapters, gpu=gpu, rates=rates,
                                        min_gain=self.cfg.min_gain, learned=load_gains(self.machine()),
                                        fp8_gather=not self.recipe.rowwise)
        choices = control.broadcast_object(choices)
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

        from tpkernels.planner.fp8_choice import gain_key, save_gains  # noqa: PLC0415

        tr, pc = self.trainer, self.trainer.pc
        first = {}
        for kind, layer in self.mine.values():
            first.setdefault(kind, layer)
        s = tr.cfg.data.seq_length // pc.cp
        sp = pc.sequence_parallel and pc.tp > 1
        keys, gains = [], []
        sync = torch.cuda.synchronize if tr.device.type == "cuda" else (lambda: None)
        gen = torch.Generator(device=tr.device).manual_seed(0)  # the run's random streams stay untouched
        for kind in self.kinds_here:
            layer = first[kind]
            if kind == "experts":  # a grouped GEMM, not a TP linear: no timing of its own (auto keeps it bf16)
                continue
            column = isinstance(layer, ColumnParallelLinear)
            k, n = layer.weight.shape[1], layer.weight.shape[0]
            if k % 16 or n % 16 or layer.qweight is not None:
                continue
            frozen = not layer.weight.requires_grad
            shape = (pc.micro_batch_size, s // pc.tp if column and sp else s, k)
            x = torch.randn(shape, dtype=layer.weight.dtype, device=layer.weight.device, generator=gen)
            args = (layer.tp_group, layer.sequence_parallel, layer.sequence_dim, layer.algo)
            timing = Fp8State(self.recipe, [kind], tr.device, guard=self.guard, reduce_group=layer.tp_group)
            fmt = Fp8Format(timing.slot(kind, layer.tp_group, column))

            def step(fp8: bool, layer=layer, column=column, frozen=frozen, x=x, args=args, fmt=fmt):
                xi = x.detach().requires_grad_()
                w = layer.weight.detach().clone().requires_grad_(not frozen)
                kw = {"weight_format": fmt if fp8 else None}
                if column:
                    y = column_parallel_linear(xi, w, None, *args, False, layer.overlap_comm, **kw)
                else:
                    y = row_parallel_linear(xi, w, None, *args, layer.overlap_comm, **kw)
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
            keys.append(gain_key(kind, pc.micro_batch_size * s, k, n, pc.tp, frozen, sp))
            gains.append(times[False] / times[True])
        gains = [g / pc.world_size for g in control.all_reduce_values(gains, "sum")]
        self.learned = dict(zip(keys, gains))
        if tr.state.rank == 0 and self.learned:
            save_gains(self.machine(), self.learned)
        return self.learned

    def table(self) -> str:
        from tpkernels.planner.fp8_choice import format_choices  # noqa: PLC0415

        head = (f"fp8 ({self.recipe.recipe}, gradients {self.recipe.grad_format}): FP8 linears "
                f"{', '.join(self.kinds) or 'none'}")
        if "experts" in self.kinds_here and "experts" not in self.kinds:
            head += ("\nfp8: the routed experts stay bf16 (fp8.layers auto has no model of their grouped GEMMs: "
                     "fp8.layers all, or a list with experts, runs them in FP8)")
        return head + ("\n" + format_choices(self.choices) if self.choices is not None else "")

    def choice_record(self) -> dict:
        rows = [] if self.choices is None else [
            {"layer": c.name, "gemm": [c.m, c.k, c.n], "predicted_gain": None if math.isnan(c.gain) else c.gain,
             "chosen": c.chosen, "reason": c.reason} for c in self.choices]
        return {"fp8_choice": {"layers": self.cfg.layers, "recipe": self.recipe.recipe, "fp8": self.kinds,
                               "table": rows}}

    def resumed(self, legacy_moved: list[dict] | None = None) -> str | None:
        """After a resume: the line that says which linears stay bf16 (None when none do). ``legacy_moved``:
        a checkpoint's ``fp8_moved`` meta list, from before the FP8 state was saved as tensors."""
        for m in legacy_moved or []:
            if m.get("layer") in self.state.index:
                self.state.disable(m["layer"], int(m.get("step", 0)))
        moved = self.state.moved
        if not moved:
            return None
        return ("fp8: resumed with " + ", ".join(f"{m['layer']} (moved after step {m['step']})" for m in moved)
                + " in bf16 (the guardrail's moves are kept)")

    @property
    def moved(self) -> list[dict]:
        return self.state.moved

    def after_step(self, step: int) -> tuple[dict, list[str], list[dict]]:
        """Close the step's FP8 state (one reduction over the world); learn the gains after the first step.
        Returns the step record's fp8 fields, the guardrail's messages and the moves made at this step."""
        if self.learn_pending:
            self.learn_pending = False
            self.learn()
        rec, messages = self.state.end_step(step)
        return rec, messages, [m for m in self.state.moved if m["step"] == step] if messages else []


__all__ = ["Fp8Policy"]
