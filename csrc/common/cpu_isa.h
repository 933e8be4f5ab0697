// What every C++ CPU op shares: the ISA variant the running CPU uses (each vectorised kernel file
// is compiled once per ISA, as ATen does), the scalar kinds, and output allocation/checking.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace tpkernels {

using OptTensor = std::optional<at::Tensor>;

enum class Isa { Default, Avx2, Avx512 };
// The best variant this CPU supports, capped by ATEN_CPU_CAPABILITY=default|avx2|avx512.
Isa cpu_isa();
const char* cpu_isa_name();

enum class ScalarKind { Float, Double, Half, BFloat16 };
// The kind of `t`, or an error naming `op` for a dtype the CPU kernels do not take.
ScalarKind kind_of(const at::Tensor& t, const char* op);

// Returns `out` after checking it can hold a result like `like` (contiguous, same shape, dtype,
// device), or a fresh contiguous tensor when `out` is empty.
at::Tensor output_like(const OptTensor& out, const at::Tensor& like, const char* op, const char* name);

// Calls `fn` with the kernel variant compiled for the running CPU: fn(cpu_default{}), ...
template <typename Default, typename Avx2, typename Avx512, typename Fn>
void with_isa(Fn&& fn) {
  switch (cpu_isa()) {
    case Isa::Avx512: fn(Avx512{}); break;
    case Isa::Avx2: fn(Avx2{}); break;
    default: fn(Default{}); break;
  }
}

}  // namespace tpkernels
