// Cross-GPU primitives for the fused GEMM + communication ops (tpkernels/functional/gemm_comm_fused.py).
//
// Signals: int32 words holding the call counter ("epoch") of the buffer set they live in; a
// producer raises one to the epoch with a system-scope release store after a fence, a consumer
// waits with system-scope acquire loads until it reads >= epoch. Waits are bounded: after
// `max_spins` reads they write `code` to the error word (pinned host memory the host reads without
// synchronizing) and give up, so a lost peer becomes an error, never a hang.
//
// Every op runs on the current CUDA stream; pointer tables (`*_ptrs`) are (world,) int64 device
// tensors of addresses (torch symmetric memory's buffer_ptrs, or other buffers of one device in
// the virtual-TP harness).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tpkernels {

#ifdef TPKERNELS_WITH_CUDA
// signals[index] = value after a system-scope fence: orders the stream's earlier work (copies) before it.
void comm_signal_set(const at::Tensor& signals, int64_t index, int64_t value);
// Block the stream until *(int32*)address >= value (acquire), or max_spins reads (then err[0] = code).
void comm_signal_wait(int64_t address, int64_t value, int64_t max_spins, const at::Tensor& err, int64_t code);
// All-gather pull: for every peer s != rank (rank+1 first) and chunk c, copy rows
// [c*chunk_rows, min(m, (c+1)*chunk_rows)) of peer s's shard (src_ptrs[s], (m, row_bytes)) into
// rows s*m + ... of `dst` ((world*m, K) contiguous), 16 bytes per load where aligned, then raise
// signals[s*chunks + c]. blocks_per_chunk blocks share a chunk; the last to finish (an
// epoch-counted ticket in counters[s*chunks + c]) raises its signal.
void comm_pull_chunks(const at::Tensor& dst, const at::Tensor& src_ptrs, int64_t rank, int64_t world, int64_t m,
                      int64_t chunk_rows, int64_t chunks, const at::Tensor& signals, const at::Tensor& counters,
                      int64_t epoch, int64_t blocks_per_chunk);
// Reduce-scatter / one-shot all-reduce consumer: out (rows, N) = scale * sum over ranks s of
// ((float*)part_ptrs[s])[(row_offset + r) * N + n], tile by tile of (tile_m x tile_n), each tile
// once signal ((int32*)sig_ptrs[s])[sig_base + tile] >= epoch for every s (sig_count: signals per
// rank, for the error codes 1 + s * sig_count + signal). Sums in fp32, in rank order (bitwise the
// same on every rank).
void comm_reduce_tiles(const at::Tensor& out, const at::Tensor& part_ptrs, const at::Tensor& sig_ptrs, int64_t world,
                       int64_t row_offset, int64_t sig_base, int64_t sig_count, int64_t tile_m, int64_t tile_n, int64_t epoch,
                       int64_t max_spins, const at::Tensor& err, double scale, int64_t blocks);
#endif

}  // namespace tpkernels
