// Device-side signal primitives shared by the comm kernels (see comm_ops.h).
#pragma once

#include <cstdint>

namespace tpkernels {

__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int32_t* p, int32_t v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Spin until *p >= value or max_spins reads; on timeout write code to *err (host-mapped) and return false.
__device__ __forceinline__ bool wait_signal(const int32_t* p, int32_t value, int64_t max_spins, int32_t* err,
                                            int32_t code) {
  for (int64_t spins = 0; spins <= max_spins; ++spins) {
    if (ld_acquire_sys(p) >= value) return true;
  }
  *reinterpret_cast<volatile int32_t*>(err) = code;
  __threadfence_system();
  return false;
}

}  // namespace tpkernels
