// AVX512 (F, BW, VL, DQ) build of the CPU kernels (picked at run time when the CPU has them).
// setup.py compiles this file with the ISA flags (CPU_ISA_FLAGS there).
#if defined(__x86_64__) && defined(__GNUC__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define TPK_CPU_NS cpu_avx512
#include "bias_gelu_cpu_kernel.h"
#else
#include "bias_gelu.h"
// Not an x86-64 GCC/Clang build: the dispatcher never selects this variant.
namespace tpkernels::cpu_avx512 {
void bias_gelu_fwd(const BiasGeluCpuArgs& a) { cpu_default::bias_gelu_fwd(a); }
void bias_gelu_bwd(const BiasGeluCpuArgs& a) { cpu_default::bias_gelu_bwd(a); }
}  // namespace tpkernels::cpu_avx512
#endif
