// Plain-ISA build of the Llama-op CPU kernels: runs on any x86-64 / aarch64 CPU.
#define TPK_CPU_NS llama_default
#include "llama_cpu_kernel.h"
