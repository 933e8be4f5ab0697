"""Time of one GEMM from its shape: an analytic model, not a lookup table.

    C (m × n) = A (m × k) · B (k × n), ``batch`` independent products, inputs in ``precision``.

Four effects make a GEMM slower than its FLOPs over the peak, and each has one constant in
``Efficiency`` (efficiency.py says where each value comes from):

1. Ceiling (``gemm`` / ``gemm_fp8``): the share of the tensor-core peak the main loop of a large
   GEMM sustains (clock under load, instruction issue, the epilogue of each tile). The H100/H200
   value is set so that an 8192³ bf16 GEMM gives the measured ≈ 790 TFLOP/s of one H200.
2. Wave quantization (``gemm_tail``): the output is cut into tiles (``gpu.tile_m × tile_n``), one
   per SM at a time. The last wave is partial; on average half a wave would idle, and stream-K /
   split-K scheduling in cuBLAS recovers part of it. With w = tiles / SMs waves, the busy share
   is 1 − tail / w for w ≥ 1, and w · (1 − tail) for fewer tiles than SMs (SMs without a tile idle).
3. Short reductions (``gemm_k0``): every tile pays a prologue (filling the shared-memory pipeline)
   and an epilogue (writing C) worth about ``gemm_k0`` iterations of k: efficiency k / (k + k0).
   This is what makes TP8 of a 4096-wide model (k = 512 on the down projection) lose.
4. Memory roof (``hbm``): a GEMM never runs faster than reading A and B and writing C at the
   achievable HBM bandwidth: small-k and skinny GEMMs are memory-bound.

plus a fixed ``gemm_launch_s`` per kernel (launch latency, the first tile's pipeline fill).

A GEMM whose B operand is a quantised weight dequantised in registers (QLoRA's NF4 / int8 linears)
reads ``b_bytes`` bytes per element of B and runs its main loop at ``compute_scale`` of the bf16
GEMM's rate (the dequantisation's extra instructions): max(compute / compute_scale, traffic).

Tile and wave counts are taken fractionally: the real curve is a sawtooth in m and n, whose
position depends on which kernel cuBLAS picks; the planner compares layouts, and the smooth
expected value keeps the model monotone: scaling m, n and k up together never lowers the
efficiency (tests/test_planner_gemm_model.py).
"""

from __future__ import annotations

from tpkernels.planner.efficiency import Efficiency
from tpkernels.planner.hardware import GPUSpec

INPUT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
OUTPUT_BYTES = {"fp32": 4}  # C is written in 16 bits otherwise (fp8 GEMMs too: TransformerEngine outputs bf16)


def _ceiling(eff: Efficiency, precision: str) -> float:
    return eff.gemm_fp8 if precision == "fp8" else eff.gemm


def wave_efficiency(tiles: float, sms: int, tail: float) -> float:
    """Busy share of the SMs over the GEMM's waves (fractional tile count, see the module doc)."""
    waves = tiles / sms
    return waves * (1.0 - tail) if waves < 1.0 else 1.0 - tail / waves


def compute_efficiency(m: float, n: float, k: float, gpu: GPUSpec, eff: Efficiency, precision: str = "bf16",
                       batch: float = 1.0) -> float:
    """Share of the peak the main loop reaches, before the memory roof and the launch cost."""
    tiles = batch * (m / gpu.tile_m) * (n / gpu.tile_n)
    return _ceiling(eff, precision) * wave_efficiency(tiles, gpu.sm_count, eff.gemm_tail) * k / (k + eff.gemm_k0)


def gemm_time(m: float, n: float, k: float, gpu: GPUSpec, eff: Efficiency, precision: str = "bf16",
              batch: float = 1.0, b_bytes: float | None = None, compute_scale: float = 1.0) -> float:
    """Seconds of ``batch`` GEMMs of (m × k) · (k × n), one kernel launch. ``b_bytes``: bytes per
    element of B when it is stored in another format than ``precision`` (a quantised weight);
    ``compute_scale``: the main loop's rate relative to a plain GEMM's (module doc)."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    flops = 2.0 * batch * m * n * k
    compute = flops / (gpu.peak_tflops(precision) * 1e12 * compute_efficiency(m, n, k, gpu, eff, precision, batch)
                       * compute_scale)
    a_bytes = INPUT_BYTES.get(precision, 2)
    traffic = batch * (a_bytes * m * k + (a_bytes if b_bytes is None else b_bytes) * k * n
                       + OUTPUT_BYTES.get(precision, 2) * m * n)
    memory = traffic / (gpu.hbm_gbs * 1e9 * eff.hbm)
    return max(compute, memory) + eff.gemm_launch_s


def achieved_efficiency(m: float, n: float, k: float, gpu: GPUSpec, eff: Efficiency, precision: str = "bf16",
                        batch: float = 1.0) -> float:
    """FLOPs over (time × peak): what a profiler would report for this GEMM."""
    t = gemm_time(m, n, k, gpu, eff, precision, batch)
    return 2.0 * batch * m * n * k / (t * gpu.peak_tflops(precision) * 1e12)


def linear_time(tokens: float, k: float, n: float, gpu: GPUSpec, eff: Efficiency, precision: str = "bf16",
                weight_grad: bool = True, weight_bytes: float | None = None,
                compute_scale: float = 1.0) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of a linear layer y = x·W, x: (tokens, k),
    W: (k, n). dX = dY·Wᵀ is (tokens × n)·(n × k); dW = Xᵀ·dY is (k × tokens)·(tokens × n).
    ``weight_bytes`` / ``compute_scale``: a quantised W read by a dequantising GEMM (gemm_time's
    b_bytes / compute_scale), in the forward and the input gradient, both of which read W."""
    fwd = gemm_time(tokens, n, k, gpu, eff, precision, b_bytes=weight_bytes, compute_scale=compute_scale)
    dgrad = gemm_time(tokens, k, n, gpu, eff, precision, b_bytes=weight_bytes, compute_scale=compute_scale)
    wgrad = gemm_time(k, n, tokens, gpu, eff, precision) if weight_grad else 0.0
    return fwd, dgrad, wgrad
