"""Mixed precision: bf16 (or fp16) weights and activations, fp32 master weights and fp32 gradient
accumulation, as Megatron's mixed-precision optimizer does.

* The model's parameters are 16-bit; the optimizer (AdamW) steps fp32 copies (``masters``) and
  the 16-bit weights are refreshed from them after each step.
* Each micro-batch's gradient, as autograd lands it (in B, or in a zero-bubble W), is added to
  the parameter's fp32 ``main_grad`` by a post-accumulate-grad hook, and ``.grad`` is dropped:
  the sum over micro-batches is fp32. (Megatron's gradient-accumulation fusion writes the fp32
  sum from the GEMM directly; here each micro-batch's gradient is rounded to 16 bits once.)
* fp16 adds dynamic loss scaling: the loss is multiplied by ``scale`` before backward; a step
  whose gradients hold inf/NaN on any rank is skipped on every rank and the scale halves; after
  ``growth_interval`` good steps it doubles. bf16 needs no scaling (fp32's exponent range).
"""

from __future__ import annotations

import torch

from tpkernels.parallel import control

# fp8: bf16 weights and activations (fp32 masters); the chosen linears' GEMMs in FP8 (tpkernels.train.fp8_policy)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64,
          "fp8": torch.bfloat16}
FULL = (torch.float32, torch.float64)  # the optimizer steps the parameters themselves


class MixedPrecision:
    """fp32 masters and main_grads for the 16-bit parameters of ``model``; ``loss_scale`` for fp16."""

    def __init__(self, model, dtype: torch.dtype, *, init_scale: float = 2.0 ** 16, growth_interval: int = 1000):
        self.dtype = dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        for p in self.params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            p.register_post_accumulate_grad_hook(self._accumulate)
        self.scaling = dtype == torch.float16
        self.scale = init_scale if self.scaling else 1.0
        self.growth_interval, self.good_steps, self.skipped = growth_interval, 0, 0

    @staticmethod
    def _accumulate(p: torch.Tensor) -> None:
        if p.grad is not None:  # autograd runs these hooks for an undefined gradient too
            p.main_grad.add_(p.grad)
            p.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.main_grad.zero_()
            p.grad = None

    def found_inf(self, group=None) -> bool:
        """Whether any rank's gradients hold inf/NaN: one all-reduce over ``group``, by default the whole
        world (every TP, PP and DP rank), so that every rank skips the step together and the loss
        scales never drift apart."""
        flag = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for p in self.params:
            flag = torch.maximum(flag, (~torch.isfinite(p.main_grad)).any().float())
        return bool(control.all_reduce_(flag, "max", group))

    def unscale_(self) -> None:
        if self.scaling and self.scale != 1.0:
            for p in self.params:
                p.main_grad.div_(self.scale)

    def update_scale(self, skipped: bool) -> None:
        if not self.scaling:
            return
        if skipped:
            self.scale /= 2.0
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0

    def step(self, optimizer) -> None:
        """optimizer (over ``masters``) steps with the main grads; the 16-bit weights follow."""
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
                m.grad = None

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        self.scale, self.good_steps, self.skipped = d["scale"], d["good_steps"], d["skipped"]
