// Vectorised CPU kernels for fused bias + GeLU, compiled once per ISA.
//
// Include this from a file that first defines TPK_CPU_NS (the namespace, e.g. cpu_avx2) and,
// for the SIMD variants, CPU_CAPABILITY / CPU_CAPABILITY_AVX2 or _AVX512 plus a matching
// `#pragma GCC target`, so at::vec::Vectorized picks the right intrinsics.
//
// Parallelism: at::parallel_for over rows (forward) or over a fixed number of row chunks
// (backward). The chunk count depends on the problem size only, never on the thread count, so
// grad_bias is bitwise reproducible whatever OMP_NUM_THREADS is.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/cpu_vec.h"
#include "bias_gelu.h"
#include "bias_gelu_math.h"

namespace tpkernels {
namespace TPK_CPU_NS {
namespace {

template <typename scalar_t, typename opmath_t>
struct BiasGeluCpu : RowIO<scalar_t, opmath_t> {
  using IO = RowIO<scalar_t, opmath_t>;
  using Vec = typename IO::Vec;
  using IO::kW;
  using IO::load;
  using IO::store;

  static Vec gelu(const Vec& z, bool tanh_approx) {
    using namespace gelu_const;
    const Vec half(opmath_t(0.5)), one(opmath_t(1));
    if (tanh_approx) {
      const Vec u = Vec(opmath_t(kSqrt2OverPi)) * (z + Vec(opmath_t(kTanhCubic)) * z * z * z);
      return half * z * (one + u.tanh());
    }
    return half * z * (one + (z * Vec(opmath_t(kInvSqrt2))).erf());
  }

  static Vec gelu_grad(const Vec& z, bool tanh_approx) {
    using namespace gelu_const;
    const Vec half(opmath_t(0.5)), one(opmath_t(1));
    if (tanh_approx) {
      const Vec z2 = z * z;
      const Vec t = (Vec(opmath_t(kSqrt2OverPi)) * (z + Vec(opmath_t(kTanhCubic)) * z2 * z)).tanh();
      return half * (one + t) + half * z * (one - t * t) * Vec(opmath_t(kSqrt2OverPi)) *
                                    (one + Vec(opmath_t(3 * kTanhCubic)) * z2);
    }
    const Vec e = (Vec(opmath_t(-0.5)) * z * z).exp();  // exp(-z^2/2), shared by Phi and phi
    if constexpr (std::is_same_v<opmath_t, float>) {
      return half * (one + erf_from_exp(z * Vec(opmath_t(kInvSqrt2)), e)) + z * Vec(opmath_t(kInvSqrt2Pi)) * e;
    } else {  // fp64: the full-precision erf (gradcheck needs ~1e-12, not 1.5e-7)
      return half * (one + (z * Vec(opmath_t(kInvSqrt2))).erf()) + z * Vec(opmath_t(kInvSqrt2Pi)) * e;
    }
  }

  // erf(a) given e = exp(-a^2), by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7): the same
  // approximation ATen's vectorised float erf uses, minus its own exp, which the backward
  // already has. Halves the transcendental work of the exact-GeLU gradient.
  static Vec erf_from_exp(const Vec& a, const Vec& e) {
    const Vec one(opmath_t(1));
    const Vec abs_a = a.abs();
    const Vec t = one / (Vec(opmath_t(0.3275911)) * abs_a + one);
    Vec r = Vec(opmath_t(1.061405429));
    r = r * t + Vec(opmath_t(-1.453152027));
    r = r * t + Vec(opmath_t(1.421413741));
    r = r * t + Vec(opmath_t(-0.284496736));
    r = r * t + Vec(opmath_t(0.254829592));
    const Vec erf_abs = one - r * t * e;
    return Vec::blendv(erf_abs, Vec(opmath_t(0)) - erf_abs, a < Vec(opmath_t(0)));
  }

  static void fwd(const BiasGeluCpuArgs& a) {
    const auto* x = static_cast<const scalar_t*>(a.x);
    const auto* b = static_cast<const scalar_t*>(a.bias);
    auto* y = static_cast<scalar_t*>(a.out);
    const int64_t cols = a.cols;
    // ~32K elements per task: large enough to amortise task start, small enough to balance.
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(cols, 1));
    at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xr = x + r * a.x_row_stride;
        scalar_t* yr = y + r * cols;
        for (int64_t c = 0; c < cols; c += kW) {
          const int64_t n = std::min(kW, cols - c);
          store(gelu(load(xr + c, n) + load(b + c, n), a.tanh_approx), yr + c, n);
        }
      }
    });
  }

  static void bwd(const BiasGeluCpuArgs& a) {
    const auto* x = static_cast<const scalar_t*>(a.x);
    const auto* g = static_cast<const scalar_t*>(a.grad_out);
    const auto* b = static_cast<const scalar_t*>(a.bias);
    auto* dx = static_cast<scalar_t*>(a.out);
    auto* db = static_cast<scalar_t*>(a.grad_bias);
    const int64_t rows = a.rows, cols = a.cols;
    // grad_bias: deterministic chunked column sums (RowIO::column_sums)
    IO::template column_sums<1>(rows, cols, [&](int64_t r, opmath_t* acc) {
      const scalar_t* xr = x + r * a.x_row_stride;
      const scalar_t* gr = g + r * a.g_row_stride;
      scalar_t* dxr = dx + r * cols;
      for (int64_t c = 0; c < cols; c += kW) {
        const int64_t n = std::min(kW, cols - c);
        const Vec z = load(xr + c, n) + load(b + c, n);
        const Vec d = load(gr + c, n) * gelu_grad(z, a.tanh_approx);
        store(d, dxr + c, n);
        // Sum the rounded value: grad_bias is then exactly the sum of the grad_x we return.
        const Vec d_rounded = std::is_same_v<scalar_t, opmath_t> ? d : load(dxr + c, n);
        (Vec::loadu(acc + c, n) + d_rounded).store(acc + c, n);
      }
    }, {db});
  }
};

}  // namespace

void bias_gelu_fwd(const BiasGeluCpuArgs& a) {
  dispatch_kind<BiasGeluCpu>(a.kind, [&](auto k) { decltype(k)::fwd(a); });
}

void bias_gelu_bwd(const BiasGeluCpuArgs& a) {
  dispatch_kind<BiasGeluCpu>(a.kind, [&](auto k) { decltype(k)::bwd(a); });
}

}  // namespace TPK_CPU_NS
}  // namespace tpkernels
