// Python bindings of tpkernels._C. Kernels live in csrc/<op>/; this file only exposes them.
#include <torch/extension.h>

#include "comm/comm_ops.h"
#include "gelu/bias_gelu.h"
#include "layer_norm/layer_norm.h"
#include "llama/llama_ops.h"
#include "quant/nf4_linear.h"

#ifdef TPKERNELS_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["version"] = TPKERNELS_VERSION;
  info["torch_version"] = TORCH_VERSION;
  info["cpu_capability"] = tpkernels::cpu_isa_name();
  info["cpu_openmp"] = tpkernels::cpu_kernels_use_openmp();
#ifdef TPKERNELS_WITH_CUDA
  info["with_cuda"] = true;
  info["cuda_archs"] = TPKERNELS_CUDA_ARCHS;
  info["cuda_runtime_version"] = CUDART_VERSION;
#else
  info["with_cuda"] = false;
  info["cuda_archs"] = "";
  info["cuda_runtime_version"] = 0;
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tpkernels compiled kernels (C++ CPU, and CUDA when built with it)";
  m.def("build_info", &build_info, "What this extension was built with: CUDA or not, SM archs, CPU ISA in use.");
  m.def("bias_gelu_fwd_cpu", &tpkernels::bias_gelu_fwd_cpu, "y = gelu(x + bias); x (rows, cols), bias (cols,)",
        pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("tanh_approx"), pybind11::arg("out") = pybind11::none());
  m.def("bias_gelu_bwd_cpu", &tpkernels::bias_gelu_bwd_cpu, "(grad_x, grad_bias) of gelu(x + bias)",
        pybind11::arg("grad_out"), pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("tanh_approx"),
        pybind11::arg("grad_x_out") = pybind11::none(), pybind11::arg("grad_bias_out") = pybind11::none());
  m.def("rms_norm_fwd_cpu", &tpkernels::rms_norm_fwd_cpu, "(y, h or None, rstd) of RMSNorm on (rows, n) views",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none(),
        pybind11::arg("out") = pybind11::none(), pybind11::arg("h_out") = pybind11::none());
  m.def("rms_norm_bwd_cpu", &tpkernels::rms_norm_bwd_cpu, "(dx, dweight) of RMSNorm from the saved h and rstd",
        pybind11::arg("dy"), pybind11::arg("h"), pybind11::arg("weight"), pybind11::arg("rstd"),
        pybind11::arg("dh") = pybind11::none(), pybind11::arg("dx_out") = pybind11::none());
  m.def("layer_norm_fwd_cpu", &tpkernels::layer_norm_fwd_cpu,
        "(y, h or None, mean, rstd) of LayerNorm on (rows, n) views", pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("bias"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none(),
        pybind11::arg("out") = pybind11::none(), pybind11::arg("h_out") = pybind11::none());
  m.def("layer_norm_bwd_cpu", &tpkernels::layer_norm_bwd_cpu,
        "(dx, dweight, dbias) of LayerNorm from the saved h, mean and rstd", pybind11::arg("dy"), pybind11::arg("h"),
        pybind11::arg("weight"), pybind11::arg("mean"), pybind11::arg("rstd"), pybind11::arg("dh") = pybind11::none(),
        pybind11::arg("dx_out") = pybind11::none());
  m.def("nf4_linear_fwd_cpu", &tpkernels::nf4_linear_fwd_cpu,
        "y = x · Wᵀ, W (out_features, K) in NF4 with double quantisation, dequantised panel by panel",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("absmax_q"), pybind11::arg("absmax_scale"),
        pybind11::arg("absmax_offset"), pybind11::arg("code"), pybind11::arg("dynamic_map"),
        pybind11::arg("out_features"), pybind11::arg("out") = pybind11::none());
  m.def("nf4_linear_bwd_cpu", &tpkernels::nf4_linear_bwd_cpu, "dx = dy · W of nf4_linear, W (N, in_features) in NF4",
        pybind11::arg("dy"), pybind11::arg("packed"), pybind11::arg("absmax_q"), pybind11::arg("absmax_scale"),
        pybind11::arg("absmax_offset"), pybind11::arg("code"), pybind11::arg("dynamic_map"),
        pybind11::arg("in_features"), pybind11::arg("out") = pybind11::none());
  m.def("swiglu_fwd_cpu", &tpkernels::swiglu_fwd_cpu, "out = silu(gate) * up on (rows, f) views",
        pybind11::arg("gate"), pybind11::arg("up"), pybind11::arg("out"));
  m.def("swiglu_bwd_cpu", &tpkernels::swiglu_bwd_cpu, "(dgate, dup) of silu(gate) * up, written into the given views",
        pybind11::arg("dy"), pybind11::arg("gate"), pybind11::arg("up"), pybind11::arg("dgate"), pybind11::arg("dup"));
  m.def("rotary_cpu", &tpkernels::rotary_cpu, "out <- x rotated by the angles of positions (conjugate: inverse)",
        pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("positions"),
        pybind11::arg("interleaved"), pybind11::arg("conjugate"), pybind11::arg("out"));
#ifdef TPKERNELS_WITH_CUDA
  m.def("bias_gelu_fwd_cuda", &tpkernels::bias_gelu_fwd_cuda, "y = gelu(x + bias); x (rows, cols), bias (cols,)",
        pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("tanh_approx"), pybind11::arg("out") = pybind11::none());
  m.def("bias_gelu_bwd_cuda", &tpkernels::bias_gelu_bwd_cuda, "(grad_x, grad_bias) of gelu(x + bias)",
        pybind11::arg("grad_out"), pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("tanh_approx"),
        pybind11::arg("grad_x_out") = pybind11::none(), pybind11::arg("grad_bias_out") = pybind11::none());
  m.def("comm_signal_set", &tpkernels::comm_signal_set, "signals[index] = value, fenced, on the current stream",
        pybind11::arg("signals"), pybind11::arg("index"), pybind11::arg("value"));
  m.def("comm_signal_wait", &tpkernels::comm_signal_wait,
        "block the current stream until *(int32*)address >= value, or max_spins reads (then err[0] = code)",
        pybind11::arg("address"), pybind11::arg("value"), pybind11::arg("max_spins"), pybind11::arg("err"),
        pybind11::arg("code"));
  m.def("comm_pull_chunks", &tpkernels::comm_pull_chunks,
        "all-gather pull of the peers' shards by a copy kernel, one signal per (peer, chunk)", pybind11::arg("dst"),
        pybind11::arg("src_ptrs"), pybind11::arg("rank"), pybind11::arg("world"), pybind11::arg("m"),
        pybind11::arg("chunk_rows"), pybind11::arg("chunks"), pybind11::arg("signals"), pybind11::arg("counters"),
        pybind11::arg("epoch"), pybind11::arg("blocks_per_chunk"));
  m.def("comm_reduce_tiles", &tpkernels::comm_reduce_tiles,
        "out = scale * sum over ranks of their signalled fp32 partial tiles", pybind11::arg("out"),
        pybind11::arg("part_ptrs"), pybind11::arg("sig_ptrs"), pybind11::arg("world"), pybind11::arg("row_offset"),
        pybind11::arg("sig_base"), pybind11::arg("sig_count"), pybind11::arg("tile_m"), pybind11::arg("tile_n"),
        pybind11::arg("epoch"), pybind11::arg("max_spins"), pybind11::arg("err"), pybind11::arg("scale"),
        pybind11::arg("blocks"));
#endif
}
