// Vector loads and stores shared by the per-ISA CPU kernels: 16-bit types are widened to the
// opmath type (float) on load and rounded back on store; partial vectors at row ends.
//
// Include from a kernel header compiled once per ISA (CPU_CAPABILITY set by the including file).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "cpu_rows.h"

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

// VecIO for the per-row kernels (norms, SwiGLU, rotary): rows of a RowsView and the parallel grain.
template <typename scalar_t, typename opmath_t>
struct RowIO : VecIO<scalar_t, opmath_t> {
  static const scalar_t* row(const RowsView& v, int64_t r) {
    return static_cast<const scalar_t*>(v.p) + r * v.row_stride;
  }

  // ~32K elements per task: large enough to amortise task start, small enough to balance.
  static int64_t grain(int64_t n) { return std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(n, 1)); }

  // kSums column sums (dweight, dbias, ...) over `rows` rows of n values, bitwise reproducible
  // whatever the thread count: the rows are cut into chunks by the shape alone (~256K elements
  // each, at most 64); visit(r, acc) handles row r and adds its terms into acc[j * n + c] (the
  // chunk's opmath rows); then the chunks are added in a fixed order into out[j][0..n).
  template <int kSums, typename Visit>
  static void column_sums(int64_t rows, int64_t n, Visit&& visit, const std::array<scalar_t*, kSums>& out) {
    if (rows == 0) {
      for (scalar_t* o : out) std::fill(o, o + n, scalar_t(0));
      return;
    }
    const int64_t nchunks = std::clamp<int64_t>(rows * n / (int64_t(1) << 18), 1, std::min<int64_t>(rows, 64));
    const int64_t per_chunk = (rows + nchunks - 1) / nchunks;
    std::vector<opmath_t> partial(static_cast<size_t>(nchunks * kSums * n), opmath_t(0));
    at::parallel_for(0, nchunks, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        opmath_t* acc = partial.data() + k * kSums * n;
        for (int64_t r = k * per_chunk; r < std::min(rows, (k + 1) * per_chunk); ++r) visit(r, acc);
      }
    });
    at::parallel_for(0, n, 4096, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        for (int j = 0; j < kSums; ++j) {
          opmath_t s = 0;
          for (int64_t k = 0; k < nchunks; ++k) s += partial[(k * kSums + j) * n + c];
          out[j][c] = static_cast<scalar_t>(s);
        }
      }
    });
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
