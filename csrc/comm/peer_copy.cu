// All-gather pull by a copy kernel (the alternative to the copy engine; see comm_ops.h).
//
// Grid (blocks_per_chunk, chunks, world - 1): block (b, c, j) copies its 1/blocks_per_chunk of
// chunk c of peer (rank + 1 + j) % world, 16 bytes per thread per step when the rows allow it
// (else 4 bytes), then joins the block and takes a ticket; the last block of the chunk raises
// the chunk's signal. Tickets count up over calls (target epoch * blocks_per_chunk), so nothing
// is reset between calls.
//
// Floor: (world - 1) * m * row_bytes bytes read over NVLink and written locally; ~16 SMs of
// 16-byte loads saturate one H100's NVLink. Unlike the copy engine it occupies SMs the GEMM
// could use: which wins is measured by benchmarks/bench_gemm_comm.py (--copy kernel|engine).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "comm_ops.h"
#include "comm_signals.cuh"

namespace tpkernels {
namespace {

constexpr int kThreads = 512;

template <typename V>
__global__ void __launch_bounds__(kThreads)
    pull_chunks_kernel(char* __restrict__ dst, const int64_t* __restrict__ src_ptrs, int rank, int world, int64_t m,
                       int64_t row_bytes, int64_t chunk_rows, int chunks, int32_t* signals, int32_t* counters,
                       int32_t epoch) {
  const int c = blockIdx.y;
  const int src = (rank + 1 + blockIdx.z) % world;
  const int64_t r0 = c * chunk_rows;
  const int64_t r1 = min(m, r0 + chunk_rows);
  if (r0 < r1) {
    const V* from = reinterpret_cast<const V*>(reinterpret_cast<const char*>(src_ptrs[src]) + r0 * row_bytes);
    V* to = reinterpret_cast<V*>(dst + (src * m + r0) * row_bytes);
    const int64_t n = (r1 - r0) * row_bytes / static_cast<int64_t>(sizeof(V));
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * kThreads) {
      to[i] = __ldcg(from + i);  // L2 only: the peer rewrites this buffer between calls
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const int sig = src * chunks + c;
    const int32_t ticket = atomicAdd(counters + sig, 1) + 1;
    if (ticket == epoch * static_cast<int32_t>(gridDim.x)) st_release_sys(signals + sig, epoch);
  }
}

}  // namespace

void comm_pull_chunks(const at::Tensor& dst, const at::Tensor& src_ptrs, int64_t rank, int64_t world, int64_t m,
                      int64_t chunk_rows, int64_t chunks, const at::Tensor& signals, const at::Tensor& counters,
                      int64_t epoch, int64_t blocks_per_chunk) {
  TORCH_CHECK(dst.is_cuda() && dst.is_contiguous() && dst.dim() == 2 && dst.size(0) == world * m,
              "dst must be a contiguous (world*m, K) CUDA tensor with world*m = ", world * m, " rows");
  TORCH_CHECK(src_ptrs.is_cuda() && src_ptrs.scalar_type() == at::kLong && src_ptrs.numel() == world,
              "src_ptrs must be a (world,) int64 CUDA tensor");
  TORCH_CHECK(signals.scalar_type() == at::kInt && signals.numel() >= world * chunks &&
                  counters.scalar_type() == at::kInt && counters.numel() >= world * chunks,
              "signals and counters must hold world*chunks = ", world * chunks, " int32");
  TORCH_CHECK(chunk_rows > 0 && blocks_per_chunk > 0, "chunk_rows (", chunk_rows, ") and blocks_per_chunk (",
              blocks_per_chunk, ") must be positive");
  if (world == 1 || m == 0) return;
  c10::cuda::CUDAGuard guard(dst.device());
  const int64_t row_bytes = dst.size(1) * dst.element_size();
  const int64_t used_chunks = (m + chunk_rows - 1) / chunk_rows;
  dim3 grid(static_cast<unsigned>(blocks_per_chunk), static_cast<unsigned>(used_chunks),
            static_cast<unsigned>(world - 1));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto* d = static_cast<char*>(dst.data_ptr());
  if (row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(d) % 16 == 0) {
    pull_chunks_kernel<int4><<<grid, kThreads, 0, stream>>>(
        d, src_ptrs.data_ptr<int64_t>(), rank, world, m, row_bytes, chunk_rows, chunks, signals.data_ptr<int32_t>(),
        counters.data_ptr<int32_t>(), static_cast<int32_t>(epoch));
  } else {
    TORCH_CHECK(row_bytes % 4 == 0, "rows of dst must be a multiple of 4 bytes, got ", row_bytes);
    pull_chunks_kernel<int32_t><<<grid, kThreads, 0, stream>>>(
        d, src_ptrs.data_ptr<int64_t>(), rank, world, m, row_bytes, chunk_rows, chunks, signals.data_ptr<int32_t>(),
        counters.data_ptr<int32_t>(), static_cast<int32_t>(epoch));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace tpkernels
