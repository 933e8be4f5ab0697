// C++ CPU kernels of nf4_linear: y = x · Wᵀ and its input gradient dx = dy · W, W (N, K) in NF4 with
// double quantisation (tpkernels/quant/nf4.py: packed codes two per byte, even flat index in the high
// nibble; 8-bit block absmax (one per 64 values of the row-major flatten) in the dynamic map, with one
// fp32 scale per 256 blocks and one fp32 offset).
//
// Never the whole weight at once: the weight is dequantised one panel at a time into a small buffer
// (forward: a block of rows × all K, about 256 KB; backward: rows × a K tile) that the ATen GEMM
// (MKL / OpenBLAS / oneDNN) multiplies; panels run in parallel (at::parallel_for; the GEMM of each
// runs on its thread). The block absmax are dequantised once per call (numel / 64 fp32 values, 1/16
// of a byte per weight). Math in fp32 (fp64 for fp64 inputs): 16-bit activations are converted once
// and the result rounded once.
//
// Work per call: 2·M·N·K FLOPs in the GEMMs plus N·K dequantisations (a nibble, a table read, a
// multiply: negligible from M ≈ 16 on); bytes 0.52·N·K of weights + the activations. The dequantised
// values equal tpkernels.quant.dequantize_nf4 (and bitsandbytes') bit for bit in fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include "../common/cpu_isa.h"

namespace tpkernels {

// x (M, K) float32/float64/float16/bfloat16; packed (ceil(N·K / 2),) uint8; absmax_q (ceil(N·K / 64),)
// uint8; absmax_scale (ceil(blocks / 256),) float32; absmax_offset () float32; code (16,) and
// dynamic_map (256,) float32 -> y (M, N), dtype of x (written into `out` when given).
at::Tensor nf4_linear_fwd_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax_q,
                              const at::Tensor& absmax_scale, const at::Tensor& absmax_offset, const at::Tensor& code,
                              const at::Tensor& dynamic_map, int64_t out_features, const OptTensor& out);
// dy (M, N) -> dx (M, K) = dy · W, dtype of dy (written into `out` when given).
at::Tensor nf4_linear_bwd_cpu(const at::Tensor& dy, const at::Tensor& packed, const at::Tensor& absmax_q,
                              const at::Tensor& absmax_scale, const at::Tensor& absmax_offset, const at::Tensor& code,
                              const at::Tensor& dynamic_map, int64_t in_features, const OptTensor& out);

}  // namespace tpkernels
