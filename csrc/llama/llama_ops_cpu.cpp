// CPU entry points of the Llama ops: validate the 2-D views, allocate outputs, pick the ISA variant.
#include <ATen/ATen.h>

#include "llama_ops.h"

namespace tpkernels {
namespace {

void check_weight(const at::Tensor& w, const at::Tensor& x) { check_feature_vector(w, x, "rms_norm", "weight"); }

template <typename Fn>
void run(Fn&& fn) {
  with_isa<llama_default::Kernels, llama_avx2::Kernels, llama_avx512::Kernels>(fn);
}

}  // namespace

std::tuple<at::Tensor, OptTensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                               double eps, const OptTensor& residual,
                                                               const OptTensor& out, const OptTensor& h_out) {
  check_rows(x, "rms_norm", "x", x);
  check_weight(weight, x);
  if (residual.has_value()) check_rows(*residual, "rms_norm", "residual", x);
  const ScalarKind kind = kind_of(x, "rms_norm");
  auto y = output_like(out, x, "rms_norm", "out");
  OptTensor h;
  if (residual.has_value()) h = output_like(h_out, x, "rms_norm", "h_out");
  auto rstd = at::empty({x.size(0)}, x.options().dtype(stat_type(x)));
  if (x.numel() == 0) return {y, h, rstd};
  RmsNormCpuArgs a{kind, x.size(0), x.size(1), eps, rows_view(x), rows_view(residual), {nullptr, 0}, {nullptr, 0},
                   weight.data_ptr(), y.data_ptr(), h.has_value() ? h->data_ptr() : nullptr, rstd.data_ptr(),
                   nullptr};
  run([&](auto k) { decltype(k)::rms_norm_fwd(a); });
  return {y, h, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& dy, const at::Tensor& h,
                                                    const at::Tensor& weight, const at::Tensor& rstd,
                                                    const OptTensor& dh, const OptTensor& dx_out) {
  check_rows(h, "rms_norm backward", "h", h);
  check_rows(dy, "rms_norm backward", "dy", h);
  if (dh.has_value()) check_rows(*dh, "rms_norm backward", "dh", h);
  check_weight(weight, h);
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == h.size(0) && rstd.is_contiguous() &&
                  rstd.scalar_type() == stat_type(h),
              "rms_norm backward: rstd must be a contiguous ", stat_type(h), " tensor of shape (", h.size(0), ",)");
  const ScalarKind kind = kind_of(h, "rms_norm backward");
  auto dx = output_like(dx_out, h, "rms_norm backward", "dx_out");
  auto dw = at::empty(weight.sizes(), weight.options());
  if (h.size(0) == 0) return {dx, dw.zero_()};
  RmsNormCpuArgs a{kind, h.size(0), h.size(1), 0.0, rows_view(h), {nullptr, 0}, rows_view(dy), rows_view(dh),
                   weight.data_ptr(), dx.data_ptr(), nullptr, const_cast<void*>(rstd.data_ptr()), dw.data_ptr()};
  run([&](auto k) { decltype(k)::rms_norm_bwd(a); });
  return {dx, dw};
}

at::Tensor swiglu_fwd_cpu(const at::Tensor& gate, const at::Tensor& up, at::Tensor out) {
  check_rows(gate, "swiglu", "gate", gate);
  check_rows(up, "swiglu", "up", gate);
  check_rows(out, "swiglu", "out", gate);
  const ScalarKind kind = kind_of(gate, "swiglu");
  if (gate.numel() == 0) return out;
  SwigluCpuArgs a{kind, gate.size(0), gate.size(1), rows_view(gate), rows_view(up), {nullptr, 0},
                  out.data_ptr(), out.stride(0), nullptr, 0};
  run([&](auto k) { decltype(k)::swiglu_fwd(a); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cpu(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up,
                                                  at::Tensor dgate, at::Tensor dup) {
  check_rows(gate, "swiglu backward", "gate", gate);
  check_rows(up, "swiglu backward", "up", gate);
  check_rows(dy, "swiglu backward", "dy", gate);
  check_rows(dgate, "swiglu backward", "dgate", gate);
  check_rows(dup, "swiglu backward", "dup", gate);
  const ScalarKind kind = kind_of(gate, "swiglu backward");
  if (gate.numel() == 0) return {dgate, dup};
  SwigluCpuArgs a{kind, gate.size(0), gate.size(1), rows_view(gate), rows_view(up), rows_view(dy),
                  dgate.data_ptr(), dgate.stride(0), dup.data_ptr(), dup.stride(0)};
  run([&](auto k) { decltype(k)::swiglu_bwd(a); });
  return {dgate, dup};
}

at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                      bool interleaved, bool conjugate, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "rotary: x must be a CPU tensor "
              "(tokens, heads, head_dim) with unit feature stride, got ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && out.stride(2) == 1,
              "rotary: out must be like x (", x.sizes(), ", ", x.scalar_type(), ", unit feature stride)");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && 2 * cos.size(1) <= x.size(2),
              "rotary: cos and sin must be contiguous float32 (max_positions, half) with 2·half <= head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1 &&
                  positions.size(0) == x.size(0),
              "rotary: positions must be a contiguous int64 tensor of shape (", x.size(0), ",)");
  const ScalarKind kind = kind_of(x, "rotary");
  if (x.numel() == 0) return out;
  RotaryCpuArgs a{kind, x.size(0), x.size(1), x.size(2), cos.size(1), x.data_ptr(), x.stride(0), x.stride(1),
                  out.data_ptr(), out.stride(0), out.stride(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
                  positions.data_ptr<int64_t>(), interleaved, conjugate};
  run([&](auto k) { decltype(k)::rotary(a); });
  return out;
}

}  // namespace tpkernels
