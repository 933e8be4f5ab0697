// Vectorised CPU kernels of RMSNorm and SwiGLU, compiled once per ISA (see llama_cpu_*.cpp).
//
// Parallelism: at::parallel_for over rows; the RMSNorm backward runs over a number of row chunks
// that depends on the problem size only, each summing its dweight rows into its own opmath row,
// then adds the chunks in a fixed order: bitwise reproducible whatever the thread count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/cpu_vec.h"
#include "llama_ops.h"

namespace tpkernels {
namespace TPK_CPU_NS {
namespace {

template <typename scalar_t, typename opmath_t>
struct LlamaCpu : RowIO<scalar_t, opmath_t> {
  using IO = RowIO<scalar_t, opmath_t>;
  using Vec = typename IO::Vec;
  using IO::grain;
  using IO::kW;
  using IO::load;
  using IO::row;
  using IO::store;
  using IO::sum;

  static void rms_norm_fwd(const RmsNormCpuArgs& a) {
    const int64_t n = a.n;
    const auto* w = static_cast<const scalar_t*>(a.weight);
    auto* rstd = static_cast<opmath_t*>(a.rstd);
    at::parallel_for(0, a.rows, grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xr = row(a.x, r);
        scalar_t* yr = static_cast<scalar_t*>(a.y) + r * n;
        const scalar_t* src = xr;  // what is normalised: x, or h as stored (rounded) with a residual
        Vec ss(opmath_t(0));
        if (a.residual.p != nullptr) {
          const scalar_t* rr = row(a.residual, r);
          scalar_t* hr = static_cast<scalar_t*>(a.h) + r * n;
          for (int64_t c = 0; c < n; c += kW) {
            const int64_t m = std::min(kW, n - c);
            store(load(xr + c, m) + load(rr + c, m), hr + c, m);
            const Vec hv = load(hr + c, m);  // the rounded h the backward will see
            ss = ss + hv * hv;
          }
          src = hr;
        } else {
          for (int64_t c = 0; c < n; c += kW) {
            const int64_t m = std::min(kW, n - c);
            const Vec v = load(xr + c, m);
            ss = ss + v * v;
          }
        }
        const opmath_t inv = opmath_t(1) / std::sqrt(sum(ss) / opmath_t(n) + opmath_t(a.eps));
        rstd[r] = inv;
        const Vec vinv(inv);
        for (int64_t c = 0; c < n; c += kW) {
          const int64_t m = std::min(kW, n - c);
          store(load(src + c, m) * vinv * load(w + c, m), yr + c, m);
        }
      }
    });
  }

  static void rms_norm_bwd(const RmsNormCpuArgs& a) {
    const int64_t rows = a.rows, n = a.n;
    const auto* w = static_cast<const scalar_t*>(a.weight);
    const auto* rstd = static_cast<const opmath_t*>(a.rstd);
    IO::template column_sums<1>(rows, n, [&](int64_t r, opmath_t* acc) {
      const scalar_t* dyr = row(a.dy, r);
      const scalar_t* hr = row(a.x, r);  // the saved h travels in `x`
      scalar_t* dxr = static_cast<scalar_t*>(a.y) + r * n;
      const Vec vr(rstd[r]);
      Vec dot(opmath_t(0));
      for (int64_t c = 0; c < n; c += kW) {
        const int64_t m = std::min(kW, n - c);
        dot = dot + load(dyr + c, m) * load(w + c, m) * load(hr + c, m) * vr;  // dn · n
      }
      const Vec mean(sum(dot) / opmath_t(n));
      for (int64_t c = 0; c < n; c += kW) {
        const int64_t m = std::min(kW, n - c);
        const Vec dyv = load(dyr + c, m);
        const Vec nv = load(hr + c, m) * vr;
        Vec dx = vr * (dyv * load(w + c, m) - nv * mean);
        if (a.dh.p != nullptr) dx = dx + load(row(a.dh, r) + c, m);
        store(dx, dxr + c, m);
        (Vec::loadu(acc + c, m) + dyv * nv).store(acc + c, m);
      }
    }, {static_cast<scalar_t*>(a.dweight)});
  }

  static Vec sigmoid(const Vec& g) {
    const Vec one(opmath_t(1));
    return one / (one + g.neg().exp());
  }

  static void swiglu_fwd(const SwigluCpuArgs& a) {
    const int64_t f = a.f;
    at::parallel_for(0, a.rows, grain(f), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* gr = row(a.gate, r);
        const scalar_t* ur = row(a.up, r);
        scalar_t* yr = static_cast<scalar_t*>(a.out) + r * a.out_stride;
        for (int64_t c = 0; c < f; c += kW) {
          const int64_t m = std::min(kW, f - c);
          const Vec g = load(gr + c, m);
          store(g * sigmoid(g) * load(ur + c, m), yr + c, m);
        }
      }
    });
  }

  static void swiglu_bwd(const SwigluCpuArgs& a) {
    const int64_t f = a.f;
    const Vec one(opmath_t(1));
    at::parallel_for(0, a.rows, grain(f), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* dyr = row(a.dy, r);
        const scalar_t* gr = row(a.gate, r);
        const scalar_t* ur = row(a.up, r);
        scalar_t* dgr = static_cast<scalar_t*>(a.out) + r * a.out_stride;
        scalar_t* dur = static_cast<scalar_t*>(a.dup) + r * a.dup_stride;
        for (int64_t c = 0; c < f; c += kW) {
          const int64_t m = std::min(kW, f - c);
          const Vec d = load(dyr + c, m), g = load(gr + c, m), u = load(ur + c, m);
          const Vec s = sigmoid(g);
          store(d * u * s * (one + g * (one - s)), dgr + c, m);
          store(d * g * s, dur + c, m);
        }
      }
    });
  }

  static void rotary(const RotaryCpuArgs& a) {
    using FIO = VecIO<float, opmath_t>;  // cos/sin are float32 whatever x is
    const int64_t half = a.half, d = a.head_dim;
    const int64_t per_token = a.heads * d;
    at::parallel_for(0, a.tokens, grain(per_token), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* cr = a.cos + a.positions[t] * half;
        const float* sr = a.sin + a.positions[t] * half;
        for (int64_t h = 0; h < a.heads; ++h) {
          const scalar_t* xr = static_cast<const scalar_t*>(a.x) + t * a.x_token_stride + h * a.x_head_stride;
          scalar_t* orow = static_cast<scalar_t*>(a.out) + t * a.out_token_stride + h * a.out_head_stride;
          if (a.interleaved) {  // pairs (2i, 2i+1): strided, scalar
            for (int64_t i = 0; i < half; ++i) {
              const opmath_t c = cr[i], s = a.conjugate ? -opmath_t(sr[i]) : opmath_t(sr[i]);
              const opmath_t x1 = xr[2 * i], x2 = xr[2 * i + 1];
              orow[2 * i] = static_cast<scalar_t>(x1 * c - x2 * s);
              orow[2 * i + 1] = static_cast<scalar_t>(x2 * c + x1 * s);
            }
          } else {  // halves (i, i + half): contiguous, vectorised
            for (int64_t i = 0; i < half; i += kW) {
              const int64_t m = std::min(kW, half - i);
              const Vec c = FIO::load(cr + i, m);
              const Vec s = a.conjugate ? FIO::load(sr + i, m).neg() : FIO::load(sr + i, m);
              const Vec x1 = load(xr + i, m), x2 = load(xr + half + i, m);
              store(x1 * c - x2 * s, orow + i, m);
              store(x2 * c + x1 * s, orow + half + i, m);
            }
          }
          if (orow != xr)  // partial rotary: the features past 2·half pass through
            for (int64_t j = 2 * half; j < d; ++j) orow[j] = xr[j];
        }
      }
    });
  }
};

}  // namespace

void rms_norm_fwd(const RmsNormCpuArgs& a) { dispatch_kind<LlamaCpu>(a.kind, [&](auto k) { decltype(k)::rms_norm_fwd(a); }); }
void rms_norm_bwd(const RmsNormCpuArgs& a) { dispatch_kind<LlamaCpu>(a.kind, [&](auto k) { decltype(k)::rms_norm_bwd(a); }); }
void swiglu_fwd(const SwigluCpuArgs& a) { dispatch_kind<LlamaCpu>(a.kind, [&](auto k) { decltype(k)::swiglu_fwd(a); }); }
void swiglu_bwd(const SwigluCpuArgs& a) { dispatch_kind<LlamaCpu>(a.kind, [&](auto k) { decltype(k)::swiglu_bwd(a); }); }
void rotary(const RotaryCpuArgs& a) { dispatch_kind<LlamaCpu>(a.kind, [&](auto k) { decltype(k)::rotary(a); }); }

}  // namespace TPK_CPU_NS
}  // namespace tpkernels
