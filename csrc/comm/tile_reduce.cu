// fp32-accumulating reduce of signalled partial tiles (see comm_ops.h): the CUDA alternative to
// the Triton reducer of tpkernels/kernels/triton/tile_reduce.py for reduce-scatter and one-shot
// all-reduce.
//
// A block takes tiles with a grid stride; thread 0 waits (acquire, system scope) for the tile's
// signal of every rank, the block joins, then each thread sums 4 consecutive floats (one 16-byte
// load per rank) of the tile's rows in rank order and writes them once, converted. A timed-out
// wait poisons the tile with NaN and leaves its code in the error word.
//
// Floor per rank: world * 4 * rows * N bytes read (all but 1/world of it over NVLink), 2 * rows * N
// written (16-bit out).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>

#include "comm_ops.h"
#include "comm_signals.cuh"

namespace tpkernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    reduce_tiles_kernel(T* __restrict__ out, int64_t out_stride, const int64_t* __restrict__ part_ptrs,
                        const int64_t* __restrict__ sig_ptrs, int world, int64_t rows, int64_t n, int64_t row_offset,
                        int64_t sig_base, int64_t sig_count, int64_t tile_m, int64_t tile_n, int32_t epoch,
                        int64_t max_spins, int32_t* err, float scale) {
  __shared__ int arrived;
  const int64_t tiles_n = (n + tile_n - 1) / tile_n;
  const int64_t tiles = ((rows + tile_m - 1) / tile_m) * tiles_n;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    if (threadIdx.x == 0) {
      int ok = 1;
      for (int s = 0; s < world; ++s) {
        const int32_t* sig = reinterpret_cast<const int32_t*>(sig_ptrs[s]) + sig_base + t;
        ok &= wait_signal(sig, epoch, max_spins, err, static_cast<int32_t>(1 + s * sig_count + sig_base + t));
      }
      arrived = ok;
    }
    __syncthreads();
    const int64_t r0 = (t / tiles_n) * tile_m, c0 = (t % tiles_n) * tile_n;
    const int64_t r1 = min(rows, r0 + tile_m), c1 = min(n, c0 + tile_n);
    const int64_t width4 = (c1 - c0 + 3) / 4;
    for (int64_t i = threadIdx.x; i < (r1 - r0) * width4; i += kThreads) {
      const int64_t r = r0 + i / width4, c = c0 + (i % width4) * 4;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int s = 0; s < world; ++s) {
        const float* p = reinterpret_cast<const float*>(part_ptrs[s]) + (row_offset + r) * n + c;
        if (c + 4 <= c1 && (reinterpret_cast<uintptr_t>(p) % 16) == 0) {
          const float4 v = __ldcg(reinterpret_cast<const float4*>(p));  // L2: peers wrote it
          acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
        } else {
          for (int k = 0; k < 4 && c + k < c1; ++k) acc[k] += __ldcg(p + k);
        }
      }
      for (int k = 0; k < 4 && c + k < c1; ++k) {
        out[r * out_stride + c + k] = static_cast<T>(arrived ? acc[k] * scale : NAN);
      }
    }
    __syncthreads();  // `arrived` is rewritten for the next tile
  }
}

}  // namespace

void comm_reduce_tiles(const at::Tensor& out, const at::Tensor& part_ptrs, const at::Tensor& sig_ptrs, int64_t world,
                       int64_t row_offset, int64_t sig_base, int64_t sig_count, int64_t tile_m, int64_t tile_n, int64_t epoch,
                       int64_t max_spins, const at::Tensor& err, double scale, int64_t blocks) {
  TORCH_CHECK(out.is_cuda() && out.dim() == 2 && out.stride(1) == 1, "out must be a (rows, N) CUDA view with unit "
              "last-dim stride");
  TORCH_CHECK(part_ptrs.scalar_type() == at::kLong && part_ptrs.numel() == world && sig_ptrs.scalar_type() == at::kLong &&
                  sig_ptrs.numel() == world,
              "part_ptrs and sig_ptrs must be (world,) int64 tensors, world = ", world);
  TORCH_CHECK(tile_m > 0 && tile_n > 0 && blocks > 0, "tile_m, tile_n and blocks must be positive");
  if (out.numel() == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(out.scalar_type(), "comm_reduce_tiles", [&] {
    reduce_tiles_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        out.data_ptr<scalar_t>(), out.stride(0), part_ptrs.data_ptr<int64_t>(), sig_ptrs.data_ptr<int64_t>(),
        static_cast<int>(world), out.size(0), out.size(1), row_offset, sig_base, sig_count, tile_m, tile_n,
        static_cast<int32_t>(epoch), max_spins, err.data_ptr<int32_t>(), static_cast<float>(scale));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace tpkernels
