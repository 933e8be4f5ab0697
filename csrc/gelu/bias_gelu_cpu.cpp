// CPU entry points: validate the 2-D views, allocate outputs, pick the ISA variant.
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

#include "bias_gelu.h"

namespace tpkernels {
namespace {

enum class Isa { Default, Avx2, Avx512 };

Isa detect_isa() {
  // ATEN_CPU_CAPABILITY=default|avx2|avx512 caps the ISA, as it does for ATen's own kernels.
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  const bool allow512 = cap == nullptr || std::strcmp(cap, "avx512") == 0;
  const bool allow2 = allow512 || (cap != nullptr && std::strcmp(cap, "avx2") == 0);
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (allow512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::Avx512;
  if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return Isa::Avx2;
#else
  (void)allow2;
#endif
  return Isa::Default;
}

Isa isa() {
  static const Isa value = detect_isa();
  return value;
}

ScalarKind kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ScalarKind::Float;
    case at::kDouble: return ScalarKind::Double;
    case at::kHalf: return ScalarKind::Half;
    case at::kBFloat16: return ScalarKind::BFloat16;
    default: TORCH_CHECK(false, "bias_gelu: dtype ", t.scalar_type(), " is not supported on the CPU "
                         "(float32, float64, float16, bfloat16)");
  }
}

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

at::Tensor output_like(const OptTensor& out, const at::Tensor& like, const char* op, const char* name) {
  if (!out.has_value()) return at::empty(like.sizes(), like.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor& o = *out;
  TORCH_CHECK(o.sizes() == like.sizes() && o.scalar_type() == like.scalar_type() && o.device() == like.device() &&
                  o.is_contiguous(),
              op, ": ", name, " must be a contiguous ", like.scalar_type(), " tensor of shape ", like.sizes(), " on ",
              like.device(), ", got ", o.scalar_type(), " ", o.sizes(), " on ", o.device());
  return o;
}

bool cpu_kernels_use_openmp() {
#ifdef _OPENMP
  return true;  // at::parallel_for really runs on torch's intra-op threads
#else
  return false;  // compiled without -fopenmp: every at::parallel_for runs serially
#endif
}

const char* bias_gelu_cpu_capability() {
  switch (isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "default";
  }
}

at::Tensor bias_gelu_fwd_cpu(const at::Tensor& x, const at::Tensor& bias, bool tanh_approx, const OptTensor& out) {
  check_2d(x, "x", x);
  check_bias(bias, x);
  const ScalarKind kind = kind_of(x);
  auto y = output_like(out, x, "bias_gelu", "out");
  if (x.numel() == 0) return y;
  BiasGeluCpuArgs a{kind, tanh_approx, x.size(0), x.size(1), x.data_ptr(), x.stride(0),
                    nullptr, 0, bias.data_ptr(), y.data_ptr(), nullptr};
  switch (isa()) {
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
  const ScalarKind kind = kind_of(x);
  auto dx = output_like(grad_x_out, x, "bias_gelu backward", "grad_x_out");
  auto db = output_like(grad_bias_out, bias, "bias_gelu backward", "grad_bias_out");
  if (x.size(0) == 0) return {dx, db.zero_()};
  if (x.size(1) == 0) return {dx, db};
  BiasGeluCpuArgs a{kind, tanh_approx, x.size(0), x.size(1), x.data_ptr(), x.stride(0),
                    grad_out.data_ptr(), grad_out.stride(0), bias.data_ptr(), dx.data_ptr(), db.data_ptr()};
  switch (isa()) {
    case Isa::Avx512: cpu_avx512::bias_gelu_bwd(a); break;
    case Isa::Avx2: cpu_avx2::bias_gelu_bwd(a); break;
    default: cpu_default::bias_gelu_bwd(a); break;
  }
  return {dx, db};
}

}  // namespace tpkernels
