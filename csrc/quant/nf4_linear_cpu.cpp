// CPU nf4_linear: panels of the NF4 weight dequantised into a small buffer, then the ATen GEMM.
// See nf4_linear.h for the layouts and the cost.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "nf4_linear.h"

namespace tpkernels {
namespace {

constexpr int64_t kBlock = 64;          // values per NF4 absmax block (tpkernels/quant/nf4.py BLOCK)
constexpr int64_t kAbsmaxBlock = 256;   // block absmax per fp32 scale (ABSMAX_BLOCK)
constexpr int64_t kPanelElems = 65536;  // forward panel: 64K values = 256 KB of fp32, an L2-sized buffer
constexpr int64_t kTileRows = 256;      // backward: rows × K tile of at most 256 × 512 values (512 KB fp32)
constexpr int64_t kTileCols = 512;

at::ScalarType opmath(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

void check_weight(const char* op, const at::Tensor& packed, const at::Tensor& absmax_q, const at::Tensor& scale,
                  const at::Tensor& offset, const at::Tensor& code, const at::Tensor& dmap, int64_t n, int64_t k) {
  const int64_t numel = n * k, blocks = (numel + kBlock - 1) / kBlock;
  auto is = [](const at::Tensor& t, at::ScalarType s, int64_t len) {
    return t.device().is_cpu() && t.scalar_type() == s && t.is_contiguous() && t.numel() == len;
  };
  TORCH_CHECK(is(packed, at::kByte, (numel + 1) / 2), op, ": packed must be a contiguous uint8 CPU tensor of ",
              (numel + 1) / 2, " bytes for a (", n, ", ", k, ") weight, got ", packed.scalar_type(), " ",
              packed.sizes());
  TORCH_CHECK(is(absmax_q, at::kByte, blocks), op, ": absmax_q must be ", blocks, " uint8 codes, got ",
              absmax_q.scalar_type(), " ", absmax_q.sizes());
  TORCH_CHECK(is(scale, at::kFloat, (blocks + kAbsmaxBlock - 1) / kAbsmaxBlock), op, ": absmax_scale must be ",
              (blocks + kAbsmaxBlock - 1) / kAbsmaxBlock, " float32 values, got ", scale.scalar_type(), " ",
              scale.sizes());
  TORCH_CHECK(is(offset, at::kFloat, 1), op, ": absmax_offset must be one float32 value");
  TORCH_CHECK(is(code, at::kFloat, 16) && is(dmap, at::kFloat, 256), op,
              ": code must be the 16 NF4 levels and dynamic_map the 256-value map, float32");
}

// The fp32 block absmax: map[q] · scale then + offset (two roundings, as the Python reference).
at::Tensor block_absmax(const at::Tensor& absmax_q, const at::Tensor& scale, const at::Tensor& offset,
                        const at::Tensor& dmap) {
  const int64_t blocks = absmax_q.numel();
  auto out = at::empty({blocks}, absmax_q.options().dtype(at::kFloat));
  const uint8_t* q = absmax_q.data_ptr<uint8_t>();
  const float* s = scale.data_ptr<float>();
  const float* m = dmap.data_ptr<float>();
  const float off = *offset.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, blocks, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float scaled = m[q[i]] * s[i / kAbsmaxBlock];
      o[i] = scaled + off;
    }
  });
  return out;
}

// buf (n1 − n0, k1 − k0), row-major, ← W[n0:n1, k0:k1] of the (·, K) NF4 weight. Walks each row one
// absmax block at a time (the scale hoisted) and one byte (two values) at a time inside it; the values
// are the same fp32 products level · absmax as element by element.
template <typename T>
void dequant_tile(const uint8_t* packed, const float* absmax, const float* code, int64_t K, int64_t n0, int64_t n1,
                  int64_t k0, int64_t k1, T* buf) {
  const int64_t w = k1 - k0;
  for (int64_t n = n0; n < n1; ++n) {
    T* row = buf + (n - n0) * w;
    int64_t f = n * K + k0;  // flat index of W[n, k0 + j]
    for (int64_t j = 0; j < w;) {
      const float a = absmax[f / kBlock];
      const int64_t end = std::min(w, j + (kBlock - f % kBlock));  // this block's last column + 1
      if (f & 1) row[j++] = static_cast<T>(code[packed[f++ >> 1] & 0xF] * a);  // a low nibble first
      for (; j + 1 < end; j += 2, f += 2) {
        const uint8_t byte = packed[f >> 1];
        row[j] = static_cast<T>(code[byte >> 4] * a);
        row[j + 1] = static_cast<T>(code[byte & 0xF] * a);
      }
      if (j < end) row[j++] = static_cast<T>(code[packed[f++ >> 1] >> 4] * a);  // a high nibble last
    }
  }
}

template <typename T>
void forward(const at::Tensor& xc, const uint8_t* packed, const float* absmax, const float* code, int64_t N,
             at::Tensor& y) {
  const int64_t K = xc.size(1);
  // at least 64 rows: a thinner panel's GEMM runs far below the GEMM's rate (K = 11008: 8 rows was slower than
  // dequantising the whole weight once); 64 × K stays a panel (2.8 MB of fp32 at K = 11008), never the weight
  const int64_t rows = std::min<int64_t>(N, std::max<int64_t>(64, (kPanelElems / std::max<int64_t>(K, 1)) / 8 * 8));
  const int64_t panels = (N + rows - 1) / rows;
  at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
    auto buf = at::empty({rows, K}, xc.options());
    for (int64_t p = b; p < e; ++p) {
      const int64_t n0 = p * rows, n1 = std::min(N, n0 + rows);
      dequant_tile<T>(packed, absmax, code, K, n0, n1, 0, K, buf.data_ptr<T>());
      auto out = y.narrow(1, n0, n1 - n0);
      at::mm_out(out, xc, buf.narrow(0, 0, n1 - n0).t());
    }
  });
}

template <typename T>
void backward(const at::Tensor& dyc, const uint8_t* packed, const float* absmax, const float* code, int64_t K,
              at::Tensor& dx) {
  const int64_t N = dyc.size(1);
  // K tiles (each thread owns whole columns of dx: no reduction across threads), N panels inside.
  const int64_t threads = at::get_num_threads();
  int64_t cols = (K + threads - 1) / threads;
  cols = std::min<int64_t>(kTileCols, std::max<int64_t>(kBlock, (cols + kBlock - 1) / kBlock * kBlock));
  const int64_t tiles = (K + cols - 1) / cols;
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    auto buf = at::empty({kTileRows, cols}, dyc.options());
    for (int64_t t = b; t < e; ++t) {
      const int64_t k0 = t * cols, k1 = std::min(K, k0 + cols);
      auto out = dx.narrow(1, k0, k1 - k0);
      for (int64_t n0 = 0; n0 < N; n0 += kTileRows) {
        const int64_t n1 = std::min(N, n0 + kTileRows);
        auto tile = buf.view({-1}).narrow(0, 0, (n1 - n0) * (k1 - k0)).view({n1 - n0, k1 - k0});
        dequant_tile<T>(packed, absmax, code, K, n0, n1, k0, k1, tile.data_ptr<T>());
        auto dy_panel = dyc.narrow(1, n0, n1 - n0);
        if (n0 == 0)
          at::mm_out(out, dy_panel, tile);
        else
          out.addmm_(dy_panel, tile);
      }
    }
  });
}

void check_act(const char* op, const char* name, const at::Tensor& t, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.size(1) == cols, op, ": ", name, " must be 2-D with ", cols, " columns, got ",
              t.sizes());
  kind_of(t, op);  // float32 / float64 / float16 / bfloat16
}

// The result in the dtype of `like`, written into `out` when given (tests pass NaN-filled ones).
at::Tensor finish(const at::Tensor& result, const at::Tensor& like, const OptTensor& out, const char* op) {
  if (!out.has_value()) return result.scalar_type() == like.scalar_type() ? result : result.to(like.scalar_type());
  const at::Tensor& o = *out;
  TORCH_CHECK(o.device().is_cpu() && o.sizes() == result.sizes() && o.scalar_type() == like.scalar_type() &&
                  o.is_contiguous(),
              op, ": out must be a contiguous ", like.scalar_type(), " CPU tensor of shape ", result.sizes(), ", got ",
              o.scalar_type(), " ", o.sizes(), " on ", o.device());
  o.copy_(result);
  return o;
}

}  // namespace

at::Tensor nf4_linear_fwd_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax_q,
                              const at::Tensor& absmax_scale, const at::Tensor& absmax_offset, const at::Tensor& code,
                              const at::Tensor& dynamic_map, int64_t out_features, const OptTensor& out) {
  constexpr const char* op = "nf4_linear";
  TORCH_CHECK(out_features >= 1, op, ": out_features (", out_features, ") must be >= 1");
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (M, K), got ", x.sizes());
  check_act(op, "x", x, x.size(1));
  check_weight(op, packed, absmax_q, absmax_scale, absmax_offset, code, dynamic_map, out_features, x.size(1));
  const auto dt = opmath(x);
  auto y = at::empty({x.size(0), out_features}, x.options().dtype(dt));
  if (x.size(0) > 0 && x.size(1) > 0) {
    auto xc = x.to(dt).contiguous();
    auto absmax = block_absmax(absmax_q, absmax_scale, absmax_offset, dynamic_map);
    if (dt == at::kDouble)
      forward<double>(xc, packed.data_ptr<uint8_t>(), absmax.data_ptr<float>(), code.data_ptr<float>(), out_features, y);
    else
      forward<float>(xc, packed.data_ptr<uint8_t>(), absmax.data_ptr<float>(), code.data_ptr<float>(), out_features, y);
  } else {
    y.zero_();
  }
  return finish(y, x, out, op);
}

at::Tensor nf4_linear_bwd_cpu(const at::Tensor& dy, const at::Tensor& packed, const at::Tensor& absmax_q,
                              const at::Tensor& absmax_scale, const at::Tensor& absmax_offset, const at::Tensor& code,
                              const at::Tensor& dynamic_map, int64_t in_features, const OptTensor& out) {
  constexpr const char* op = "nf4_linear backward";
  TORCH_CHECK(in_features >= 1, op, ": in_features (", in_features, ") must be >= 1");
  TORCH_CHECK(dy.dim() == 2, op, ": dy must be 2-D (M, N), got ", dy.sizes());
  check_act(op, "dy", dy, dy.size(1));
  check_weight(op, packed, absmax_q, absmax_scale, absmax_offset, code, dynamic_map, dy.size(1), in_features);
  const auto dt = opmath(dy);
  auto dx = at::empty({dy.size(0), in_features}, dy.options().dtype(dt));
  if (dy.size(0) > 0 && dy.size(1) > 0) {
    auto dyc = dy.to(dt).contiguous();
    auto absmax = block_absmax(absmax_q, absmax_scale, absmax_offset, dynamic_map);
    if (dt == at::kDouble)
      backward<double>(dyc, packed.data_ptr<uint8_t>(), absmax.data_ptr<float>(), code.data_ptr<float>(), in_features, dx);
    else
      backward<float>(dyc, packed.data_ptr<uint8_t>(), absmax.data_ptr<float>(), code.data_ptr<float>(), in_features, dx);
  } else {
    dx.zero_();
  }
  return finish(dx, dy, out, op);
}

}  // namespace tpkernels
