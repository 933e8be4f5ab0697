// Plain-ISA build of the CPU kernels: runs on any x86-64 / aarch64 CPU.
#define TPK_CPU_NS cpu_default
#include "bias_gelu_cpu_kernel.h"
