// AVX2 build of the Llama-op CPU kernels (picked at run time when the CPU has it); setup.py
// compiles this file with the ISA flags (CPU_ISA_FLAGS there).
#if defined(__x86_64__) && defined(__GNUC__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define TPK_CPU_NS llama_avx2
#include "llama_cpu_kernel.h"
#else
#include "llama_ops.h"
// Not an x86-64 GCC/Clang build: the dispatcher never selects this variant.
namespace tpkernels::llama_avx2 {
void rms_norm_fwd(const RmsNormCpuArgs& a) { llama_default::rms_norm_fwd(a); }
void rms_norm_bwd(const RmsNormCpuArgs& a) { llama_default::rms_norm_bwd(a); }
void swiglu_fwd(const SwigluCpuArgs& a) { llama_default::swiglu_fwd(a); }
void swiglu_bwd(const SwigluCpuArgs& a) { llama_default::swiglu_bwd(a); }
void rotary(const RotaryCpuArgs& a) { llama_default::rotary(a); }
}  // namespace tpkernels::llama_avx2
#endif
