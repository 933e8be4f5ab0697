// AVX512 build of the LayerNorm CPU kernels (picked at run time when the CPU has it); setup.py
// compiles this file with the ISA flags (CPU_ISA_FLAGS there).
#if defined(__x86_64__) && defined(__GNUC__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define TPK_CPU_NS layer_norm_avx512
#include "layer_norm_cpu_kernel.h"
#else
#include "layer_norm.h"
// Not an x86-64 GCC/Clang build: the dispatcher never selects this variant.
namespace tpkernels::layer_norm_avx512 {
void layer_norm_fwd(const LayerNormCpuArgs& a) { layer_norm_default::layer_norm_fwd(a); }
void layer_norm_bwd(const LayerNormCpuArgs& a) { layer_norm_default::layer_norm_bwd(a); }
}  // namespace tpkernels::layer_norm_avx512
#endif
