// Vectorised CPU kernels of LayerNorm, compiled once per ISA (see layer_norm_cpu_*.cpp).
//
// Parallelism: at::parallel_for over rows; the backward runs over a number of row chunks that
// depends on the problem size only, each summing its dweight / dbias rows into its own opmath rows,
// then adds the chunks in a fixed order: bitwise reproducible whatever the thread count. Every sum
// over a row is a vector accumulation followed by a lane-ordered reduction (deterministic too).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/cpu_vec.h"
#include "layer_norm.h"

namespace tpkernels {
namespace TPK_CPU_NS {
namespace {

template <typename scalar_t, typename opmath_t>
struct LayerNormCpu : RowIO<scalar_t, opmath_t> {
  using IO = RowIO<scalar_t, opmath_t>;
  using Vec = typename IO::Vec;
  using IO::grain;
  using IO::kW;
  using IO::load;
  using IO::row;
  using IO::store;
  using IO::sum;

  // Σ over a row of n elements of f(c, m) (the vector at column c, m <= kW lanes valid), in four
  // independent accumulators: one would stall on the add's latency (4 cycles) at every vector, and a
  // reduction pass over a cached row would cost more than its memory traffic. Fixed order: deterministic.
  template <typename F>
  static Vec row_sum(int64_t n, F&& f) {
    Vec a0(opmath_t(0)), a1(opmath_t(0)), a2(opmath_t(0)), a3(opmath_t(0));
    int64_t c = 0;
    for (; c + 4 * kW <= n; c += 4 * kW) {
      a0 = a0 + f(c, kW);
      a1 = a1 + f(c + kW, kW);
      a2 = a2 + f(c + 2 * kW, kW);
      a3 = a3 + f(c + 3 * kW, kW);
    }
    for (; c < n; c += kW) a0 = a0 + f(c, std::min(kW, n - c));
    return (a0 + a1) + (a2 + a3);
  }

  static void layer_norm_fwd(const LayerNormCpuArgs& a) {
    const int64_t n = a.n;
    const auto* w = static_cast<const scalar_t*>(a.weight);
    const auto* b = static_cast<const scalar_t*>(a.bias);
    auto* mean_out = static_cast<opmath_t*>(a.mean);
    auto* rstd_out = static_cast<opmath_t*>(a.rstd);
    at::parallel_for(0, a.rows, grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* src = row(a.x, r);  // what is normalised: x, or h as stored (rounded) with a residual
        scalar_t* yr = static_cast<scalar_t*>(a.y) + r * n;
        Vec s;
        if (a.residual.p != nullptr) {
          const scalar_t* rr = row(a.residual, r);
          scalar_t* hr = static_cast<scalar_t*>(a.h) + r * n;
          s = row_sum(n, [&](int64_t c, int64_t m) {
            store(load(src + c, m) + load(rr + c, m), hr + c, m);
            return load(hr + c, m);  // the rounded h the backward will see
          });
          src = hr;
        } else {
          s = row_sum(n, [&](int64_t c, int64_t m) { return load(src + c, m); });
        }
        const opmath_t mu = sum(s) / opmath_t(n);
        const Vec vmu(mu);
        const Vec ss = row_sum(n, [&](int64_t c, int64_t m) {
          const Vec d = load(src + c, m) - vmu;
          // the lanes past the row's end load 0 and would add mu² each: keep the row's lanes only
          return m == kW ? d * d : Vec::set(Vec(opmath_t(0)), d * d, m);
        });
        const opmath_t inv = opmath_t(1) / std::sqrt(sum(ss) / opmath_t(n) + opmath_t(a.eps));
        mean_out[r] = mu;
        rstd_out[r] = inv;
        const Vec vinv(inv);
        if (b != nullptr) {
          for (int64_t c = 0; c < n; c += kW) {
            const int64_t m = std::min(kW, n - c);
            store((load(src + c, m) - vmu) * vinv * load(w + c, m) + load(b + c, m), yr + c, m);
          }
        } else {
          for (int64_t c = 0; c < n; c += kW) {
            const int64_t m = std::min(kW, n - c);
            store((load(src + c, m) - vmu) * vinv * load(w + c, m), yr + c, m);
          }
        }
      }
    });
  }

  static void layer_norm_bwd(const LayerNormCpuArgs& a) {
    const int64_t rows = a.rows, n = a.n;
    const auto* w = static_cast<const scalar_t*>(a.weight);
    const auto* mean = static_cast<const opmath_t*>(a.mean);
    const auto* rstd = static_cast<const opmath_t*>(a.rstd);
    // acc: n dweight sums, then n dbias sums
    IO::template column_sums<2>(rows, n, [&](int64_t r, opmath_t* acc_w) {
      opmath_t* acc_b = acc_w + n;
      const scalar_t* dyr = row(a.dy, r);
      const scalar_t* hr = row(a.x, r);  // the saved h travels in `x`
      scalar_t* dxr = static_cast<scalar_t*>(a.y) + r * n;
      const Vec vmu(mean[r]), vr(rstd[r]);
      // Σ g and Σ g · x̂ (the lanes past the row's end load dy = 0: g = 0), two vectors a step
      Vec sg0(opmath_t(0)), sg1(opmath_t(0)), sgx0(opmath_t(0)), sgx1(opmath_t(0));
      int64_t i = 0;
      for (; i + 2 * kW <= n; i += 2 * kW) {
        const Vec g0 = load(dyr + i, kW) * load(w + i, kW);
        const Vec g1 = load(dyr + i + kW, kW) * load(w + i + kW, kW);
        sg0 = sg0 + g0;
        sg1 = sg1 + g1;
        sgx0 = sgx0 + g0 * ((load(hr + i, kW) - vmu) * vr);
        sgx1 = sgx1 + g1 * ((load(hr + i + kW, kW) - vmu) * vr);
      }
      for (; i < n; i += kW) {
        const int64_t m = std::min(kW, n - i);
        const Vec g = load(dyr + i, m) * load(w + i, m);
        sg0 = sg0 + g;
        sgx0 = sgx0 + g * ((load(hr + i, m) - vmu) * vr);
      }
      const Vec mean_gx(sum(sgx0 + sgx1) / opmath_t(n)), mean_g(sum(sg0 + sg1) / opmath_t(n));
      for (int64_t c = 0; c < n; c += kW) {
        const int64_t m = std::min(kW, n - c);
        const Vec dyv = load(dyr + c, m);
        const Vec xh = (load(hr + c, m) - vmu) * vr;
        Vec dx = vr * (dyv * load(w + c, m) - mean_g - xh * mean_gx);
        if (a.dh.p != nullptr) dx = dx + load(row(a.dh, r) + c, m);
        store(dx, dxr + c, m);
        (Vec::loadu(acc_w + c, m) + dyv * xh).store(acc_w + c, m);
        (Vec::loadu(acc_b + c, m) + dyv).store(acc_b + c, m);
      }
    }, {static_cast<scalar_t*>(a.dweight), static_cast<scalar_t*>(a.dbias)});
  }
};

}  // namespace

void layer_norm_fwd(const LayerNormCpuArgs& a) {
  dispatch_kind<LayerNormCpu>(a.kind, [&](auto k) { decltype(k)::layer_norm_fwd(a); });
}
void layer_norm_bwd(const LayerNormCpuArgs& a) {
  dispatch_kind<LayerNormCpu>(a.kind, [&](auto k) { decltype(k)::layer_norm_bwd(a); });
}

}  // namespace TPK_CPU_NS
}  // namespace tpkernels
