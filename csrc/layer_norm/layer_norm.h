// C++ CPU kernels of LayerNorm (GPT-2 family) with the fused residual add.
//
//   forward:  h = x (+ residual, stored: the residual stream); mean = Σh / n;
//             rstd = 1 / sqrt(Σ(h − mean)² / n + eps); y = (h − mean) · rstd · weight (+ bias)
//   backward: x̂ = (h − mean) · rstd; g = dy · weight;
//             dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)) (+ dh); dweight = Σ_rows dy · x̂; dbias = Σ_rows dy
//
// Tensor views seen by the kernels (the Python launchers flatten leading dims first): x, residual,
// dy, dh (rows, n), last-dim stride 1, any row stride; weight, bias (n,) contiguous; y, h, dx (rows,
// n) contiguous; mean, rstd (rows,) float32 (float64 for float64). The variance is the two-pass
// one (Σ(h − mean)², not Σh² − n·mean²: no cancellation when |mean| >> std); a row is re-read
// from cache, not from memory.
//
// Traffic floors per element (b bytes of the dtype): forward 2b (4b with the residual), backward 3b
// (4b with dh), plus O(n) per row chunk for the dweight / dbias partial sums and 8 bytes (16 for
// float64) of statistics per row. FLOPs per element: forward 8 (residual add, Σh, centre, square
// and Σ, · rstd, · weight, + bias), backward 15 (centre, · rstd, g, Σg, g · x̂ and Σ, the dx
// combination (4), + dh, dy · x̂ and Σ, Σdy): far below any CPU's FLOP/byte balance, so the kernels are
// memory-bound. Math in float (double for double).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "../common/cpu_isa.h"
#include "../common/cpu_rows.h"

namespace tpkernels {

// -> (y, h (defined only with a residual), mean, rstd). bias: optional; out / h_out: optional
// preallocated outputs, written in full (tests pass NaN-filled ones).
std::tuple<at::Tensor, OptTensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, double eps, const OptTensor& residual,
    const OptTensor& out, const OptTensor& h_out);
// -> (dx, dweight, dbias); dh: the gradient arriving at h directly (the residual stream), added to dx.
// dbias is Σ_rows dy whether or not the forward had a bias (one add per element).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(const at::Tensor& dy, const at::Tensor& h,
                                                                  const at::Tensor& weight, const at::Tensor& mean,
                                                                  const at::Tensor& rstd, const OptTensor& dh,
                                                                  const OptTensor& dx_out);

// Raw-pointer interface of the per-ISA kernels.
struct LayerNormCpuArgs {
  ScalarKind kind;
  int64_t rows, n;
  double eps;
  RowsView x, residual, dy, dh;  // residual / dh: p == nullptr when absent; backward: x is the saved h
  const void* weight;
  const void* bias;  // nullptr: no bias
  void* y;           // forward: y; backward: dx (contiguous)
  void* h;           // forward with a residual: h (contiguous)
  void* mean;        // (rows,), float (double for double)
  void* rstd;
  void* dweight;     // backward: (n,) each, in the dtype of weight
  void* dbias;
};

#define TPK_DECLARE_LAYER_NORM_CPU(ns)                                             \
  namespace ns {                                                                   \
  void layer_norm_fwd(const LayerNormCpuArgs&);                                    \
  void layer_norm_bwd(const LayerNormCpuArgs&);                                    \
  struct Kernels {                                                                 \
    static void layer_norm_fwd(const LayerNormCpuArgs& a) { ns::layer_norm_fwd(a); } \
    static void layer_norm_bwd(const LayerNormCpuArgs& a) { ns::layer_norm_bwd(a); } \
  };                                                                               \
  }
TPK_DECLARE_LAYER_NORM_CPU(layer_norm_default)
TPK_DECLARE_LAYER_NORM_CPU(layer_norm_avx2)
TPK_DECLARE_LAYER_NORM_CPU(layer_norm_avx512)
#undef TPK_DECLARE_LAYER_NORM_CPU

}  // namespace tpkernels
