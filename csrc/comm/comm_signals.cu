// Stream-ordered signal set and wait (see comm_ops.h). One thread each: they order work, they
// move no data. The set's fence makes every earlier write of the stream (a cudaMemcpyAsync of
// the copy engine, a kernel's stores) visible system-wide before the signal can be seen.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "comm_ops.h"
#include "comm_signals.cuh"

namespace tpkernels {
namespace {

__global__ void signal_set_kernel(int32_t* p, int32_t value) {
  __threadfence_system();
  st_release_sys(p, value);
}

__global__ void signal_wait_kernel(const int32_t* p, int32_t value, int64_t max_spins, int32_t* err, int32_t code) {
  wait_signal(p, value, max_spins, err, code);
}

}  // namespace

void comm_signal_set(const at::Tensor& signals, int64_t index, int64_t value) {
  TORCH_CHECK(signals.is_cuda() && signals.scalar_type() == at::kInt && signals.is_contiguous(),
              "signals must be a contiguous int32 CUDA tensor, got ", signals.scalar_type(), " on ", signals.device());
  TORCH_CHECK(0 <= index && index < signals.numel(), "index (", index, ") must be in [0, ", signals.numel(), ")");
  c10::cuda::CUDAGuard guard(signals.device());
  signal_set_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(signals.data_ptr<int32_t>() + index,
                                                                   static_cast<int32_t>(value));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void comm_signal_wait(int64_t address, int64_t value, int64_t max_spins, const at::Tensor& err, int64_t code) {
  TORCH_CHECK(address != 0 && address % 4 == 0, "address (", address, ") must be a non-null 4-byte-aligned pointer");
  TORCH_CHECK(err.scalar_type() == at::kInt && err.numel() >= 1, "err must hold one int32");
  signal_wait_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const int32_t*>(address), static_cast<int32_t>(value), max_spins, err.data_ptr<int32_t>(),
      static_cast<int32_t>(code));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace tpkernels
