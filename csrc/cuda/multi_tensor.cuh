// Multi-tensor launch: one kernel launch covers many tensors, each cut into fixed-size chunks,
// one thread block per chunk. The host packs tensor addresses and where each tensor's blocks
// start into the kernel's argument block (no device-side table to allocate or copy), and
// launches again every 36 tensors. A few hundred flat shards or a thousand small parameters
// become a handful of launches instead of one per tensor per operation.
#pragma once

// c10's CUDA headers only: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers, which
// a minimal CUDA toolkit (nvcc + runtime) does not ship.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace zeroengine {

// Elements per block. Large enough that a block's loop amortises its setup, small enough that a
// 100M-element shard still spreads over every SM many times.
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

// The kernel's argument block (well under the 4 KB parameter limit): up to 36 whole tensors per
// launch, and where each tensor's blocks start. There is no per-block table, so one launch may
// have any number of blocks: a single 1B-element shard is one launch of ~15k blocks that fills
// the GPU, rather than a series of launches capped by a table's size.
template <int Lists>
struct TensorTable {
  static constexpr int kMaxTensors = 36;
  void* addr[Lists][kMaxTensors];
  int64_t numel[kMaxTensors];
  int block_start[kMaxTensors + 1];  // blocks of tensor t: [block_start[t], block_start[t+1])
  int64_t tag[kMaxTensors];  // per tensor, the caller's number (multi_tensor_apply's tags)
  int tensors;
};

// This block's tensor, the first element of its chunk and the chunk's length.
template <int Lists>
__device__ __forceinline__ int locate(const TensorTable<Lists>& table, int64_t& start,
                                      int64_t& n) {
  const int block = static_cast<int>(blockIdx.x);
  int t = 0;
  while (t + 1 < table.tensors && block >= table.block_start[t + 1]) ++t;
  start = static_cast<int64_t>(block - table.block_start[t]) * kChunk;
  n = table.numel[t] - start < kChunk ? table.numel[t] - start : kChunk;
  return t;
}

// Calls launch(table, blocks) as often as needed so that every element of every tensor is in
// exactly one block. lists[l][t] is tensor t of list l; all lists have the same length and each
// tensor t has the same numel in every list.
// ``tags`` (optional, one per tensor): a number the kernel reads as table.tag[t].
template <int Lists, typename Launch>
void multi_tensor_apply(const std::vector<std::vector<at::Tensor>>& lists, Launch launch,
                        const std::vector<int64_t>* tags = nullptr) {
  using Table = TensorTable<Lists>;
  TORCH_CHECK(static_cast<int>(lists.size()) == Lists, "expected ", Lists, " tensor lists");
  const size_t n = lists[0].size();
  TORCH_CHECK(tags == nullptr || tags->size() == n, "expected one tag per tensor");
  for (const auto& l : lists)
    TORCH_CHECK(l.size() == n, "tensor lists differ in length: ", l.size(), " vs ", n);
  Table table;
  table.tensors = 0;
  table.block_start[0] = 0;
  int64_t blocks = 0;
  for (size_t t = 0; t < n; ++t) {
    const int64_t numel = lists[0][t].numel();
    if (numel == 0) continue;
    for (int l = 0; l < Lists; ++l) {
      TORCH_CHECK(lists[l][t].numel() == numel, "tensor ", t, " of list ", l, " has ",
                  lists[l][t].numel(), " elements, list 0 has ", numel);
      table.addr[l][table.tensors] = lists[l][t].data_ptr();
    }
    table.numel[table.tensors] = numel;
    table.tag[table.tensors] = tags != nullptr ? (*tags)[t] : 0;
    blocks += (numel + kChunk - 1) / kChunk;
    TORCH_CHECK(blocks < (int64_t{1} << 31), "tensor ", t, " is too large for one launch");
    table.block_start[++table.tensors] = static_cast<int>(blocks);
    if (table.tensors == Table::kMaxTensors) {
      launch(table, static_cast<int>(blocks));
      table.tensors = 0;
      blocks = 0;
    }
  }
  if (table.tensors > 0) launch(table, static_cast<int>(blocks));
}

}  // namespace zeroengine
