// CPU entry points: validate the 2-D views, allocate outputs, pick the ISA variant.
#include <ATen/ATen.h>

#include "bias_gelu.h"

namespace tpkernels {
namespace {

void check_2d(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.device().is_cpu(), "bias_gelu: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, "bias_gelu: ", name, " must be 2-D (rows, cols), got ", t.dim(), "-D");
  TORCH_CHECK(t.sizes() == x.sizes(), "bias_gelu: ", name, " shape ", t.sizes(), " must equal x shape ", x.sizes());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "bias_gelu: ", name, " must have last-dim stride 1");
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "bias_gelu: ", name, " dtype ", t.scalar_type(),
              " must equal x dtype ", x.scalar_type());
}

void check_bias(const at::Tensor& bias, const at::Tensor& x) {
  TORCH_CHECK(bias.device().is_cpu(), "bias_gelu: bias must be a CPU tensor, got ", bias.device());
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == x.size(1), "bias_gelu: bias shape ", bias.sizes(),
              " must be (", x.size(1), ",), the last dim of x");
  TORCH_CHECK(bias.is_contiguous(), "bias_gelu: bias must be contiguous");
  TORCH_CHECK(bias.scalar_type() == x.scalar_type(), "bias_gelu: bias dtype ", bias.scalar_type(),
              " must equal x dtype ", x.scalar_type());
}

}  // namespace

bool cpu_kernels_use_openmp() {
#ifdef _OPENMP
  return true;  // at::parallel_for really runs on torch's intra-op threads
#else
  return false;  // compiled without -fopenmp: every at::parallel_for runs serially
#endif
}

at::Tensor bias_gelu_fwd_cpu(const at::Tensor& x, const at::Tensor& bias, bool tanh_approx, const OptTensor& out) {
  check_2d(x, "x", x);
  check_bias(bias, x);
  const ScalarKind kind = kind_of(x, "bias_gelu");
  auto y = output_like(out, x, "bias_gelu", "out");
  if (x.numel() == 0) return y;
  BiasGeluCpuArgs a{kind, tanh_approx, x.size(0), x.size(1), x.data_ptr(), x.stride(0),
                    nullptr, 0, bias.data_ptr(), y.data_ptr(), nullptr};
  switch (cpu_isa()) {
    case Isa::Avx512: cpu_avx512::bias_gelu_fwd(a); break;
    case Isa::Avx2: cpu_avx2::bias_gelu_fwd(a); break;
    default: cpu_default::bias_gelu_fwd(a); break;
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                     const at::Tensor& bias, bool tanh_approx,
                                                     const OptTensor& grad_x_out, const OptTensor& grad_bias_out) {
  check_2d(x, "x", x);
  check_2d(grad_out, "grad_out", x);
  check_bias(bias, x);
  const ScalarKind kind = kind_of(x, "bias_gelu");
  auto dx = output_like(grad_x_out, x, "bias_gelu backward", "grad_x_out");
  auto db = output_like(grad_bias_out, bias, "bias_gelu backward", "grad_bias_out");
  if (x.size(0) == 0) return {dx, db.zero_()};
  if (x.size(1) == 0) return {dx, db};
  BiasGeluCpuArgs a{kind, tanh_approx, x.size(0), x.size(1), x.data_ptr(), x.stride(0),
                    grad_out.data_ptr(), grad_out.stride(0), bias.data_ptr(), dx.data_ptr(), db.data_ptr()};
  switch (cpu_isa()) {
    case Isa::Avx512: cpu_avx512::bias_gelu_bwd(a); break;
    case Isa::Avx2: cpu_avx2::bias_gelu_bwd(a); break;
    default: cpu_default::bias_gelu_bwd(a); break;
  }
  return {dx, db};
}

}  // namespace tpkernels
