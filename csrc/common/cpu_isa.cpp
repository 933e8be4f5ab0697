#include "cpu_isa.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

namespace tpkernels {
namespace {

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

}  // namespace

Isa cpu_isa() {
  static const Isa value = detect_isa();
  return value;
}

const char* cpu_isa_name() {
  switch (cpu_isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "default";
  }
}

ScalarKind kind_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return ScalarKind::Float;
    case at::kDouble: return ScalarKind::Double;
    case at::kHalf: return ScalarKind::Half;
    case at::kBFloat16: return ScalarKind::BFloat16;
    default: TORCH_CHECK(false, op, ": dtype ", t.scalar_type(), " is not supported on the CPU "
                         "(float32, float64, float16, bfloat16)");
  }
}

at::Tensor output_like(const OptTensor& out, const at::Tensor& like, const char* op, const char* name) {
  if (!out.has_value()) return at::empty(like.sizes(), like.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor& o = *out;
  TORCH_CHECK(o.sizes() == like.sizes() && o.scalar_type() == like.scalar_type() && o.device() == like.device() &&
                  o.is_contiguous(),
              op, ": ", name, " must be a contiguous ", like.scalar_type(), " tensor of shape ", like.sizes(), " on ",
              like.device(), ", got ", o.scalar_type(), " ", o.sizes(), " on ", o.device());
  return o;
}

}  // namespace tpkernels
