// Multi-tensor launch: one kernel launch covers many tensors, each cut into fixed-size chunks,
// one thread block per chunk. The host packs tensor addresses and a (tensor, chunk) table into
// the kernel's argument block (no device-side table to allocate or copy), and launches again
// whenever the table fills. A few hundred flat shards or a thousand small parameters become a
// handful of launches instead of one per tensor per operation.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace zeroengine {

// Elements per block. Large enough that a block's loop amortises its setup, small enough that a
// 100M-element shard still spreads over every SM.
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

// The argument block must stay under the 4 KB kernel-parameter limit of older toolchains:
// 5 lists x 36 addresses (1440 B) + 36 sizes (288 B) + 256 x (1 + 4) B of block table.
template <int Lists>
struct TensorTable {
  static constexpr int kMaxTensors = 36;
  static constexpr int kMaxBlocks = 256;
  void* addr[Lists][kMaxTensors];
  int64_t numel[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};

// Calls launch(table, blocks) as often as needed so that every element of every tensor is in
// exactly one block. lists[l][t] is tensor t of list l; all lists have the same length and each
// tensor t has the same numel in every list.
template <int Lists, typename Launch>
void multi_tensor_apply(const std::vector<std::vector<at::Tensor>>& lists, Launch launch) {
  using Table = TensorTable<Lists>;
  TORCH_CHECK(static_cast<int>(lists.size()) == Lists, "expected ", Lists, " tensor lists");
  const size_t n = lists[0].size();
  for (const auto& l : lists)
    TORCH_CHECK(l.size() == n, "tensor lists differ in length: ", l.size(), " vs ", n);
  Table table;
  int tensors = 0, blocks = 0;
  for (size_t t = 0; t < n; ++t) {
    const int64_t numel = lists[0][t].numel();
    if (numel == 0) continue;
    for (int l = 0; l < Lists; ++l) {
      TORCH_CHECK(lists[l][t].numel() == numel, "tensor ", t, " of list ", l, " has ",
                  lists[l][t].numel(), " elements, list 0 has ", numel);
      table.addr[l][tensors] = lists[l][t].data_ptr();
    }
    table.numel[tensors] = numel;
    const int64_t chunks = (numel + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[blocks] = static_cast<unsigned char>(tensors);
      table.block_chunk[blocks] = static_cast<int>(c);
      ++blocks;
      const bool table_full = blocks == Table::kMaxBlocks;
      const bool last_chunk = c == chunks - 1;
      const bool tensors_full = last_chunk && tensors + 1 == Table::kMaxTensors;
      if (table_full || tensors_full) {
        launch(table, blocks);
        blocks = 0;
        if (last_chunk) {
          tensors = -1;  // the next tensor starts a fresh table
        } else {
          // the rest of this tensor continues in the next launch, as its table's entry 0
          for (int l = 0; l < Lists; ++l) table.addr[l][0] = table.addr[l][tensors];
          table.numel[0] = table.numel[tensors];
          tensors = 0;
        }
      }
    }
    ++tensors;
  }
  if (blocks > 0) launch(table, blocks);
}

}  // namespace zeroengine
