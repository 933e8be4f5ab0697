// Fused bias + GeLU: y = gelu(x + bias), bias broadcast over the last dim.
//
// Tensor views seen by every kernel (callers flatten leading dims first):
//   x, grad_out: (rows, cols), last-dim stride 1, any row stride
//   bias:        (cols,), contiguous
//   y, grad_x:   (rows, cols), contiguous, dtype of x
//   grad_bias:   (cols,), dtype of bias; sum over rows of grad_x, accumulated in fp32 (fp64 for fp64)
//
// Traffic floor per element (b = bytes of the dtype): forward reads x, writes y -> 2b;
// backward reads grad_out and x, writes grad_x -> 3b (bias and the per-block bias partial
// sums are O(cols) and negligible when rows >> 1).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "../common/cpu_isa.h"

namespace tpkernels {

// `out`, `grad_x_out`, `grad_bias_out`: optional preallocated outputs (contiguous, right shape
// and dtype), written in full; tests pass NaN-filled ones to prove every element is written.

at::Tensor bias_gelu_fwd_cpu(const at::Tensor& x, const at::Tensor& bias, bool tanh_approx, const OptTensor& out);
std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                     const at::Tensor& bias, bool tanh_approx,
                                                     const OptTensor& grad_x_out, const OptTensor& grad_bias_out);
// Whether the CPU kernels were compiled with OpenMP (torch's at::parallel_for backend).
bool cpu_kernels_use_openmp();

#ifdef TPKERNELS_WITH_CUDA
at::Tensor bias_gelu_fwd_cuda(const at::Tensor& x, const at::Tensor& bias, bool tanh_approx, const OptTensor& out);
std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                      const at::Tensor& bias, bool tanh_approx,
                                                      const OptTensor& grad_x_out, const OptTensor& grad_bias_out);
#endif

// Raw-pointer interface of the per-ISA CPU kernels (no ATen Tensor inside them, so the code
// compiled for AVX2/AVX512 shares as little inline code with the rest as possible).

struct BiasGeluCpuArgs {
  ScalarKind kind;
  bool tanh_approx;
  int64_t rows, cols;
  const void* x;            // (rows, cols), row stride x_row_stride
  int64_t x_row_stride;
  const void* grad_out;     // backward only: (rows, cols), row stride g_row_stride
  int64_t g_row_stride;
  const void* bias;         // (cols,)
  void* out;                // forward: y; backward: grad_x. (rows, cols) contiguous
  void* grad_bias;          // backward only: (cols,), dtype of bias (== dtype of x)
};

namespace cpu_default { void bias_gelu_fwd(const BiasGeluCpuArgs&); void bias_gelu_bwd(const BiasGeluCpuArgs&); }
namespace cpu_avx2 { void bias_gelu_fwd(const BiasGeluCpuArgs&); void bias_gelu_bwd(const BiasGeluCpuArgs&); }
namespace cpu_avx512 { void bias_gelu_fwd(const BiasGeluCpuArgs&); void bias_gelu_bwd(const BiasGeluCpuArgs&); }

}  // namespace tpkernels
