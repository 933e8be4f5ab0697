// Plain-ISA build of the LayerNorm CPU kernels: runs on any x86-64 / aarch64 CPU.
#define TPK_CPU_NS layer_norm_default
#include "layer_norm_cpu_kernel.h"
