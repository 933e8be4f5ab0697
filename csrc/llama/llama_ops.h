// C++ CPU kernels of the Llama-family ops: RMSNorm (with the fused residual add) and SwiGLU.
//
// Tensor views seen by the kernels (the Python launchers flatten leading dims first):
//   rms_norm:  x, residual, dy, dh (rows, n), last-dim stride 1, any row stride; weight (n,)
//              contiguous; y, h, dx (rows, n) contiguous; rstd (rows,) float32 (float64 for float64)
//   swiglu:    gate, up, dy, dgate, dup (rows, f), last-dim stride 1, any row stride (the halves of
//              a fused [gate | up] tensor are such views)
//
//   rotary:    x, out (tokens, heads, head_dim), unit feature stride, any token/head strides
//
// Traffic floors per element (b bytes of the dtype): rms_norm forward 2b (4b with the residual),
// backward 3b (4b with dh), plus O(n) per row chunk for the dweight partial sums; swiglu forward
// 3b, backward 5b; rotary 2b (its cos/sin row is read once per token for all heads). Math in
// float (double for double).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "../common/cpu_isa.h"
#include "../common/cpu_rows.h"

namespace tpkernels {

// -> (y, h (defined only with a residual), rstd). out / h_out / dx_out: optional preallocated
// outputs, written in full (tests pass NaN-filled ones).
std::tuple<at::Tensor, OptTensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                               double eps, const OptTensor& residual,
                                                               const OptTensor& out, const OptTensor& h_out);
// -> (dx, dweight); dh: the gradient arriving at h directly (the residual stream), added to dx
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& dy, const at::Tensor& h,
                                                    const at::Tensor& weight, const at::Tensor& rstd,
                                                    const OptTensor& dh, const OptTensor& dx_out);
at::Tensor swiglu_fwd_cpu(const at::Tensor& gate, const at::Tensor& up, at::Tensor out);
// out (tokens, heads, head_dim) <- x rotated by the angles of `positions` (conjugate: the inverse
// rotation); cos, sin (max_positions, half) float32; x and out may be the same tensor (in place).
at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                      bool interleaved, bool conjugate, at::Tensor out);
std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cpu(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up,
                                                  at::Tensor dgate, at::Tensor dup);

// Raw-pointer interface of the per-ISA kernels (RowsView: csrc/common/cpu_rows.h).

struct RmsNormCpuArgs {
  ScalarKind kind;
  int64_t rows, n;
  double eps;
  RowsView x, residual, dy, dh;  // residual / dh: p == nullptr when absent
  const void* weight;
  void* y;      // forward: y; backward: dx (contiguous)
  void* h;      // forward with a residual: h (contiguous)
  void* rstd;   // (rows,), float (double for double)
  void* dweight;
};

struct SwigluCpuArgs {
  ScalarKind kind;
  int64_t rows, f;
  RowsView gate, up, dy;
  void* out;      // forward: y
  int64_t out_stride;
  void* dup;      // backward: out = dgate, dup
  int64_t dup_stride;
};

struct RotaryCpuArgs {
  ScalarKind kind;
  int64_t tokens, heads, head_dim, half;
  const void* x;
  int64_t x_token_stride, x_head_stride;
  void* out;
  int64_t out_token_stride, out_head_stride;
  const float* cos;  // (max_positions, half)
  const float* sin;
  const int64_t* positions;  // (tokens,)
  bool interleaved, conjugate;
};

#define TPK_DECLARE_LLAMA_CPU(ns)                          \
  namespace ns {                                           \
  void rms_norm_fwd(const RmsNormCpuArgs&);                \
  void rms_norm_bwd(const RmsNormCpuArgs&);                \
  void swiglu_fwd(const SwigluCpuArgs&);                   \
  void swiglu_bwd(const SwigluCpuArgs&);                   \
  void rotary(const RotaryCpuArgs&);                       \
  struct Kernels {                                         \
    static void rms_norm_fwd(const RmsNormCpuArgs& a) { ns::rms_norm_fwd(a); } \
    static void rms_norm_bwd(const RmsNormCpuArgs& a) { ns::rms_norm_bwd(a); } \
    static void swiglu_fwd(const SwigluCpuArgs& a) { ns::swiglu_fwd(a); }      \
    static void swiglu_bwd(const SwigluCpuArgs& a) { ns::swiglu_bwd(a); }      \
    static void rotary(const RotaryCpuArgs& a) { ns::rotary(a); }              \
  };                                                       \
  }
TPK_DECLARE_LLAMA_CPU(llama_default)
TPK_DECLARE_LLAMA_CPU(llama_avx2)
TPK_DECLARE_LLAMA_CPU(llama_avx512)
#undef TPK_DECLARE_LLAMA_CPU

}  // namespace tpkernels
