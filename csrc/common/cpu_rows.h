// Row views of 2-D tensors as the per-row CPU kernels (the norms, SwiGLU) see them, and the checks
// their entry points share: (rows, n), last-dim stride 1, any row stride.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace tpkernels {

// Raw rows for the per-ISA kernels: row r starts at p + r * row_stride (elements); p == nullptr: absent.
struct RowsView {
  const void* p;
  int64_t row_stride;
};

inline RowsView rows_view(const at::Tensor& t) { return {t.data_ptr(), t.stride(0)}; }
inline RowsView rows_view(const std::optional<at::Tensor>& t) {
  return t.has_value() ? rows_view(*t) : RowsView{nullptr, 0};
}

// `t` (named `name` in errors of `op`) is a CPU (rows, n) view like `like`: same shape and dtype,
// last-dim stride 1.
inline void check_rows(const at::Tensor& t, const char* op, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.sizes() == like.sizes(), op, ": ", name, " must be 2-D of shape ", like.sizes(),
              ", got ", t.sizes());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, op, ": ", name, " must have last-dim stride 1");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " dtype ", t.scalar_type(), " must be ",
              like.scalar_type());
}

// `v` is a contiguous (n,) CPU tensor of the dtype of `x` (rows, n): a per-feature parameter.
inline void check_feature_vector(const at::Tensor& v, const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(v.device().is_cpu() && v.dim() == 1 && v.size(0) == x.size(1) && v.is_contiguous() &&
                  v.scalar_type() == x.scalar_type(),
              op, ": ", name, " must be a contiguous ", x.scalar_type(), " CPU tensor of shape (", x.size(1),
              ",), got ", v.scalar_type(), " ", v.sizes());
}

// The dtype of per-row statistics: float32 (float64 for float64 inputs).
inline at::ScalarType stat_type(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace tpkernels
