// Vector loads and stores shared by the per-ISA CPU kernels: 16-bit types are widened to the
// opmath type (float) on load and rounded back on store; partial vectors at row ends.
//
// Include from a kernel header compiled once per ISA (CPU_CAPABILITY set by the including file).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "cpu_isa.h"

namespace tpkernels {
namespace TPK_CPU_NS {
namespace {

template <typename scalar_t, typename opmath_t>
struct VecIO {
  using Vec = at::vec::Vectorized<opmath_t>;
  static constexpr int64_t kW = Vec::size();

  static Vec load(const scalar_t* p, int64_t n) {
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      return n == kW ? Vec::loadu(p) : Vec::loadu(p, n);
    } else {
      opmath_t buf[kW];
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<opmath_t>(p[i]);
      return Vec::loadu(buf, n);
    }
  }

  static void store(const Vec& v, scalar_t* p, int64_t n) {
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      if (n == kW) v.store(p); else v.store(p, n);
    } else {
      opmath_t buf[kW];
      v.store(buf, n);
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<scalar_t>(buf[i]);
    }
  }

  // Sum of the first n lanes, in lane order (deterministic).
  static opmath_t sum(const Vec& v, int64_t n = kW) {
    opmath_t buf[kW];
    v.store(buf);
    opmath_t s = 0;
    for (int64_t i = 0; i < n; ++i) s += buf[i];
    return s;
  }
};

// fn(K<scalar_t, opmath_t>{}) for the scalar kind: 16-bit types compute in float.
template <template <typename, typename> class K, typename Fn>
void dispatch_kind(ScalarKind kind, Fn&& fn) {
  switch (kind) {
    case ScalarKind::Float: fn(K<float, float>{}); break;
    case ScalarKind::Double: fn(K<double, double>{}); break;
    case ScalarKind::Half: fn(K<c10::Half, float>{}); break;
    case ScalarKind::BFloat16: fn(K<c10::BFloat16, float>{}); break;
  }
}

}  // namespace
}  // namespace TPK_CPU_NS
}  // namespace tpkernels
