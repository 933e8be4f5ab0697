"""Column- and row-parallel ``nn.Linear`` replacements (Megatron-LM semantics).

    fc1 = ColumnParallelLinear.from_linear(model.fc1, tp_group, sequence_parallel=True)
    fc2 = RowParallelLinear.from_linear(model.fc2, tp_group, sequence_parallel=True)
    y_shard = fc2(gelu(fc1(x_shard)))     # x_shard, y_shard: this rank's 1/P of the sequence

Without sequence parallelism: the column layer takes a replicated input and returns its slice of
the output features (all of them with ``gather_output=True``); the row layer takes that slice
(``input_is_parallel=True``) or the full input, and returns the full output on every rank.
With sequence parallelism, inputs and outputs of the pair are sharded along ``sequence_dim``
(0 for Megatron's (seq, batch, hidden), 1 for (batch, seq, hidden)) and the all-gather /
reduce-scatter are overlapped with the GEMMs (``overlap_comm``; ``algo`` picks the GEMM-comm
algorithm, "auto" by the rule of :mod:`tpkernels.backends`).

``quant="nf4"`` (or "int8"): the weight is a frozen quantised base (QLoRA): held as a
:class:`~tpkernels.functional.quantized_weight.QuantizedWeight` (``layer.qweight``), never as a
full-precision parameter; ``layer.weight`` is then a meta tensor that keeps the shard's shape,
dtype and TP tag for whoever reads them (LoRA). Load it with ``load_quantized_`` (or
``from_linear``); ``dequantize_()`` turns it back into an ordinary frozen parameter (export).
``enable_fp8(...)``: the GEMMs run in FP8, the casts through the layer's slot of an
:class:`~tpkernels.quant.fp8_state.Fp8State` (the run state's one owner). Every format runs the one
communication schedule of :mod:`tpkernels.functional.tp_linear`.

Weight gradients use the package's one weight-gradient mechanism
(:mod:`tpkernels.functional.weight_grad`): inside a zero-bubble schedule they are deferred to the
W action without any change to the layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tpkernels.functional.fp8_format import Fp8Format
from tpkernels.functional.gemm_comm import check_algo
from tpkernels.functional.quantized_weight import QuantizedWeight, triton_shape_problem
from tpkernels.functional.tp_linear import column_parallel_linear, row_parallel_linear
from tpkernels.functional.weight_format import DENSE, QuantizedFormat
from tpkernels.quant.fp8_state import Fp8Recipe, Fp8Slot, Fp8State
from tpkernels.parallel.groups import group_rank_size
from tpkernels.parallel.param_tags import tag
from tpkernels.parallel.mappings import (
    all_gather_dim,
    check_divisible,
    gather_from_tensor_parallel,
    scatter_to_tensor_parallel,
)

_SP = " when sequence_parallel=True"


def _init_like_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's default init with the full layer's fan-in (each shard draws from the same law)."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        weight.uniform_(-bound, bound)  # kaiming_uniform_(a=√5) reduces to U(±1/√fan_in)
        if bias is not None:
            bias.uniform_(-bound, bound)


class _TPLinear(nn.Module):
    def __init__(self, tp_group, sequence_parallel: bool, overlap_comm: bool, sequence_dim: int, algo: str,
                 quant: str | None = None):
        super().__init__()
        check_algo(algo, overlap_comm)
        if quant is not None and algo == "fused":
            raise ValueError("algo ('fused') reads a 16-bit weight tensor; a quantised layer (quant "
                             f"{quant!r}) runs 'ring', 'collective' or 'auto'")
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = group_rank_size(tp_group)
        self.sequence_parallel, self.overlap_comm, self.sequence_dim = sequence_parallel, overlap_comm, sequence_dim
        self.algo, self.quant = algo, quant
        self.qweight: QuantizedWeight | None = None
        self.fp8: Fp8Slot | None = None

    def enable_fp8(self, recipe: Fp8Recipe | None = None, *, state: Fp8State | None = None,
                   name: str = "linear") -> Fp8Slot:
        """Run this layer's GEMMs in FP8 (:mod:`tpkernels.functional.fp8_format`), casting through the slot
        ``name`` of ``state`` (a model's one FP8 state), or of a state of its own with ``recipe``
        (``layer.fp8.state``: ``end_step()`` closes a step, ``disable(name)`` moves it back to 16 bits)."""
        if self.qweight is not None:
            raise ValueError(f"fp8 on a quantised (quant {self.quant!r}) layer: its GEMM is the dequantising NF4 / "
                             "int8 kernel; FP8 training of a QLoRA base is not supported (use bf16 with qlora)")
        k, n = self.weight.shape[1], self.weight.shape[0]
        for dim, v in (("in_features per rank", k), ("out_features per rank", n)):
            if v % 16:
                raise ValueError(f"fp8: {type(self).__name__} {n}×{k} per rank: {dim} ({v}) must be a multiple of 16 "
                                 "(FP8 GEMMs take 16-element multiples)")
        if state is None:
            state = Fp8State(recipe or Fp8Recipe(), [name], self.weight.device, reduce_group=self.tp_group)
        self.fp8 = state.slot(name, self.tp_group, isinstance(self, ColumnParallelLinear))
        return self.fp8

    @property
    def fp8_active(self) -> bool:
        return self.fp8 is not None and self.fp8.enabled

    @property
    def weight_format(self):
        """How this layer's weight multiplies now: quantised, FP8 or dense."""
        if self.qweight is not None:
            return QuantizedFormat(self.qweight)
        return Fp8Format(self.fp8) if self.fp8_active else DENSE

    def _weight_arg(self):
        return None if self.qweight is not None else self.weight

    def _make_weight(self, shape: tuple[int, int], split_dim: int, device, dtype) -> None:
        """A full-precision parameter, or with ``quant`` a meta tensor standing for the quantised shard."""
        if self.quant is None:
            self.weight = tag(nn.Parameter(torch.empty(shape, device=device, dtype=dtype)), split_dim=split_dim)
            return
        dtype = dtype or torch.get_default_dtype()
        if self.quant == "nf4" and device is not None and torch.device(device).type == "cuda":
            problem = triton_shape_problem(shape[1], f"quantised {type(self).__name__} {shape[0]}×{shape[1]} per rank")
            if problem:
                raise ValueError(problem)
        self.weight = tag(torch.empty(shape, device="meta", dtype=dtype), split_dim=split_dim)
        self.qweight = QuantizedWeight(self.quant, shape, dtype, device)

    @property
    def weight_device(self) -> torch.device:
        """Where the weight lives (a quantised one: where its codes do)."""
        return self.qweight.device if self.qweight is not None else self.weight.device

    def load_quantized_(self, weight: torch.Tensor, row_splits: list[int] | None = None) -> "_TPLinear":
        """Quantise this rank's full-precision shard ``weight`` into the layer (``row_splits``: rows of each
        Hugging Face tensor it is made of, each quantised on its own)."""
        if self.qweight is None:
            raise ValueError("load_quantized_ needs a layer built with quant='nf4' or 'int8'")
        self.qweight.load_(weight, row_splits)
        return self

    @torch.no_grad()
    def dequantize_(self, values: torch.Tensor | None = None) -> "_TPLinear":
        """Replace the quantised weight by its dequantised values as a frozen parameter (then merge_lora_,
        save_hf and to_linear work as for any layer). ``values`` (this shard's shape): dequantised values to
        hold instead of this layer's own codes (an export rebuilding another TP size's shards)."""
        if self.qweight is None:
            return self
        if values is not None and tuple(values.shape) != self.qweight.shape:
            raise ValueError(f"values of shape {tuple(values.shape)} must have the layer's shard shape "
                             f"{self.qweight.shape}")
        w = self.qweight.dequantize() if values is None else values.to(self.qweight.device, self.qweight.dtype)
        t = self.weight.tp_tag
        del self.weight
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight.tp_tag = t
        self.qweight, self.quant = None, None
        return self

    def _load_shard(self, weight: torch.Tensor, bias: torch.Tensor | None) -> "_TPLinear":
        with torch.no_grad():
            if self.qweight is not None:
                self.qweight.load_(weight)
            else:
                self.weight.copy_(weight)
            if self.bias is not None:
                self.bias.copy_(bias)
        return self

    def _weight_values(self) -> torch.Tensor:
        return self.qweight.dequantize() if self.qweight is not None else self.weight.detach()

    def _check_input(self, x: torch.Tensor, features: int, name: str) -> None:
        if x.dim() < 2 and self.sequence_parallel:
            raise ValueError(f"input must have a sequence dim with sequence_parallel=True, got shape {tuple(x.shape)}")
        if x.shape[-1] != features:
            raise ValueError(f"input's last dim ({x.shape[-1]}) must equal {name} ({features})")


class ColumnParallelLinear(_TPLinear):
    """y = x·Wᵀ + b with W's output rows split over the TP group: weight (out/P, in), bias (out/P,)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_group=None,
                 gather_output: bool = False, sequence_parallel: bool = False, overlap_comm: bool = True, *,
                 sequence_dim: int = 0, regather_input: bool = False, algo: str = "auto", device=None, dtype=None,
                 quant: str | None = None):
        super().__init__(tp_group, sequence_parallel, overlap_comm, sequence_dim, algo, quant)
        check_divisible(out_features, self.tp_size, "out_features")
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True cannot be combined with sequence_parallel=True "
                             "(the output of an SP column layer feeds a row-parallel layer)")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.regather_input = gather_output, regather_input
        self.out_per_rank = out_features // self.tp_size
        kw = dict(device=device, dtype=dtype)
        self._make_weight((self.out_per_rank, in_features), 0, device, dtype)
        self.bias = tag(nn.Parameter(torch.empty(self.out_per_rank, **kw)), split_dim=0) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in) — with SP this rank's shard of ``sequence_dim``. Returns (..., out/P) over the full
        sequence, or (..., out) with ``gather_output``."""
        self._check_input(x, self.in_features, "in_features")
        y = column_parallel_linear(x, self._weight_arg(), self.bias, self.tp_group, self.sequence_parallel,
                                   self.sequence_dim, self.algo, self.regather_input, self.overlap_comm,
                                   weight_format=self.weight_format)
        return gather_from_tensor_parallel(y, self.tp_group) if self.gather_output else y

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_group=None, **kwargs) -> "ColumnParallelLinear":
        """Shard a dense layer: this rank keeps output rows [r·out/P, (r+1)·out/P)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, tp_group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        rows = slice(layer.tp_rank * layer.out_per_rank, (layer.tp_rank + 1) * layer.out_per_rank)
        return layer._load_shard(linear.weight[rows], None if linear.bias is None else linear.bias[rows])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense layer's weight (out, in) and bias (out,), gathered on every rank (collective)."""
        sd = {"weight": all_gather_dim(self._weight_values(), 0, self.tp_group)}
        if self.bias is not None:
            sd["bias"] = all_gather_dim(self.bias.detach(), 0, self.tp_group)
        return sd

    def to_linear(self) -> nn.Linear:
        sd = self.full_state_dict()
        dense = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                          device=self.weight_device, dtype=self.weight.dtype)
        dense.load_state_dict(sd)
        return dense

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_per_rank} per rank), "
                f"bias={self.bias is not None}, tp_size={self.tp_size}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}, overlap_comm={self.overlap_comm}, algo={self.algo}")


class RowParallelLinear(_TPLinear):
    """y = x·Wᵀ + b with W's input columns split over the TP group: weight (out, in/P), bias (out,)
    replicated and added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, overlap_comm: bool = True, *,
                 sequence_dim: int = 0, algo: str = "auto", device=None, dtype=None, quant: str | None = None):
        super().__init__(tp_group, sequence_parallel, overlap_comm, sequence_dim, algo, quant)
        check_divisible(in_features, self.tp_size, "in_features")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True requires input_is_parallel=True "
                             "(the input of an SP row layer is the output of a column-parallel layer)")
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        self.in_per_rank = in_features // self.tp_size
        kw = dict(device=device, dtype=dtype)
        self._make_weight((out_features, self.in_per_rank), 1, device, dtype)
        # replicated, added after the reduction; under SP its gradient is summed inside the op
        self.bias = tag(nn.Parameter(torch.empty(out_features, **kw))) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in/P) (or (..., in) with ``input_is_parallel=False``) over the full sequence.
        Returns (..., out): with SP this rank's shard of ``sequence_dim``."""
        if not self.input_is_parallel:
            self._check_input(x, self.in_features, "in_features")
            x = scatter_to_tensor_parallel(x, self.tp_group)
        self._check_input(x, self.in_per_rank, "in_features / tensor_parallel_size")
        if self.sequence_parallel:
            check_divisible(x.shape[self.sequence_dim], self.tp_size, "sequence length", _SP)
        return row_parallel_linear(x, self._weight_arg(), self.bias, self.tp_group, self.sequence_parallel,
                                   self.sequence_dim, self.algo, self.overlap_comm, weight_format=self.weight_format)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_group=None, **kwargs) -> "RowParallelLinear":
        """Shard a dense layer: this rank keeps input columns [r·in/P, (r+1)·in/P) and the whole bias."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, tp_group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        cols = slice(layer.tp_rank * layer.in_per_rank, (layer.tp_rank + 1) * layer.in_per_rank)
        return layer._load_shard(linear.weight[:, cols], linear.bias)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {"weight": all_gather_dim(self._weight_values(), 1, self.tp_group)}
        if self.bias is not None:
            sd["bias"] = self.bias.detach().clone()
        return sd

    def to_linear(self) -> nn.Linear:
        dense = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                          device=self.weight_device, dtype=self.weight.dtype)
        dense.load_state_dict(self.full_state_dict())
        return dense

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} per rank), out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}, overlap_comm={self.overlap_comm}, algo={self.algo}")
