// CPU entry points of LayerNorm: validate the 2-D views, allocate outputs, pick the ISA variant.
#include <ATen/ATen.h>

#include <cmath>

#include "layer_norm.h"

namespace tpkernels {
namespace {

constexpr const char* kFwd = "layer_norm";
constexpr const char* kBwd = "layer_norm backward";

void check_stat(const at::Tensor& s, const at::Tensor& h, const char* name) {
  TORCH_CHECK(s.device().is_cpu() && s.dim() == 1 && s.size(0) == h.size(0) && s.is_contiguous() &&
                  s.scalar_type() == stat_type(h),
              kBwd, ": ", name, " must be a contiguous ", stat_type(h), " CPU tensor of shape (", h.size(0),
              ",), got ", s.scalar_type(), " ", s.sizes());
}

template <typename Fn>
void run(Fn&& fn) {
  with_isa<layer_norm_default::Kernels, layer_norm_avx2::Kernels, layer_norm_avx512::Kernels>(fn);
}

}  // namespace

std::tuple<at::Tensor, OptTensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, double eps, const OptTensor& residual,
    const OptTensor& out, const OptTensor& h_out) {
  check_rows(x, kFwd, "x", x);
  check_feature_vector(weight, x, kFwd, "weight");
  if (bias.has_value()) check_feature_vector(*bias, x, kFwd, "bias");
  if (residual.has_value()) check_rows(*residual, kFwd, "residual", x);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, kFwd, ": eps (", eps, ") must be a finite number >= 0");
  const ScalarKind kind = kind_of(x, kFwd);
  auto y = output_like(out, x, kFwd, "out");
  OptTensor h;
  if (residual.has_value()) h = output_like(h_out, x, kFwd, "h_out");
  auto mean = at::empty({x.size(0)}, x.options().dtype(stat_type(x)));
  auto rstd = at::empty({x.size(0)}, x.options().dtype(stat_type(x)));
  if (x.numel() == 0) return {y, h, mean, rstd};
  LayerNormCpuArgs a{kind, x.size(0), x.size(1), eps, rows_view(x), rows_view(residual), {nullptr, 0},
                     {nullptr, 0}, weight.data_ptr(), bias.has_value() ? bias->data_ptr() : nullptr, y.data_ptr(),
                     h.has_value() ? h->data_ptr() : nullptr, mean.data_ptr(), rstd.data_ptr(), nullptr, nullptr};
  run([&](auto k) { decltype(k)::layer_norm_fwd(a); });
  return {y, h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(const at::Tensor& dy, const at::Tensor& h,
                                                                  const at::Tensor& weight, const at::Tensor& mean,
                                                                  const at::Tensor& rstd, const OptTensor& dh,
                                                                  const OptTensor& dx_out) {
  check_rows(h, kBwd, "h", h);
  check_rows(dy, kBwd, "dy", h);
  if (dh.has_value()) check_rows(*dh, kBwd, "dh", h);
  check_feature_vector(weight, h, kBwd, "weight");
  check_stat(mean, h, "mean");
  check_stat(rstd, h, "rstd");
  const ScalarKind kind = kind_of(h, kBwd);
  auto dx = output_like(dx_out, h, kBwd, "dx_out");
  auto dw = at::empty(weight.sizes(), weight.options());
  auto db = at::empty(weight.sizes(), weight.options());
  if (h.size(0) == 0 || h.size(1) == 0) return {dx, dw.zero_(), db.zero_()};
  LayerNormCpuArgs a{kind, h.size(0), h.size(1), 0.0, rows_view(h), {nullptr, 0}, rows_view(dy), rows_view(dh),
                     weight.data_ptr(), nullptr, dx.data_ptr(), nullptr, const_cast<void*>(mean.data_ptr()),
                     const_cast<void*>(rstd.data_ptr()), dw.data_ptr(), db.data_ptr()};
  run([&](auto k) { decltype(k)::layer_norm_bwd(a); });
  return {dx, dw, db};
}

}  // namespace tpkernels
