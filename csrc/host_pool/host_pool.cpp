// A host-memory pool for the engine's large transient CPU buffers: stage 3's gathered segments
// and the gradient staging of its reduce-scatter.
//
// Why: those buffers are freed and allocated again every step, the same sizes each time, with
// the model's activations allocated in between. Through malloc, a freed 4 MB segment's hole is
// taken by activations and the next gather of that segment extends the heap: the resident peak
// grows by what the heap cannot give back (on the 25M GPT at stage 3 this pool took ~20 MB per
// rank off the peak; the rest of stage 3's excess was gloo's all-gather temporary, see
// distributed/comm.py). glibc's mmap threshold would keep them apart but rises to the largest
// freed block, and a lower fixed threshold re-faults every page each step (~20% step time).
//
// How: each buffer is one private anonymous mapping, kept (resident) when freed and handed out
// again to the next request of the same page-rounded size. The pool never maps more than the
// largest number of bytes that were live in it at one time: a request that finds no block of
// its size first unmaps free blocks of other sizes until it fits under that mark. Tensors
// whose storage comes from here (empty()) resize through the pool too, so
// `untyped_storage().resize_(0)` / `resize_(n)` (how a segment is released and re-gathered)
// return and take blocks.
#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <torch/version.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace {

// Allocator::allocate became non-const and copy_data was added in torch 2.3.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define ZE_ALLOCATE_CONST
#define ZE_HAS_COPY_DATA 1
#else
#define ZE_ALLOCATE_CONST const
#define ZE_HAS_COPY_DATA 0
#endif

size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

class HostPool final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t n) ZE_ALLOCATE_CONST override {
    if (n == 0) return {nullptr, nullptr, &HostPool::release, at::Device(at::kCPU)};
    return self().take(n);
  }

  at::DeleterFnPtr raw_deleter() const override { return &HostPool::release; }

#if ZE_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#endif

  static HostPool& self() {
    // never destroyed: tensors still holding blocks may be freed after static destructors ran
    static HostPool* pool = new HostPool();
    return *pool;
  }

  std::map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {{"live_bytes", static_cast<int64_t>(live_)},
            {"cached_bytes", static_cast<int64_t>(cached_)},
            {"peak_live_bytes", static_cast<int64_t>(peak_live_)},
            {"maps", static_cast<int64_t>(maps_)},
            {"reuses", static_cast<int64_t>(reuses_)}};
  }

  // Unmaps every free block (what is live stays); the next requests map afresh.
  void trim() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) unmap(p, size);
      blocks.clear();
    }
    free_.clear();
    cached_ = 0;
  }

 private:
  at::DataPtr take(size_t n) {
    const size_t size = (n + page_size() - 1) / page_size() * page_size();
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_ -= size;
        ++reuses_;
      } else {
        peak_live_ = std::max(peak_live_, live_ + size);
        evict_for(size);
      }
      live_ += size;
    }
    if (p == nullptr) {
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        std::lock_guard<std::mutex> lock(mu_);
        live_ -= size;
        TORCH_CHECK(false, "zeroengine host pool: cannot map ", size, " bytes (out of memory)");
      }
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[p] = size;
      ++maps_;
    }
    return {p, p, &HostPool::release, at::Device(at::kCPU)};
  }

  // Under mu_: unmap free blocks of other sizes until mapping `size` more keeps the pool
  // within the most bytes it ever had live at once.
  void evict_for(size_t size) {
    for (auto it = free_.begin(); it != free_.end() && live_ + cached_ + size > peak_live_;) {
      auto& blocks = it->second;
      while (!blocks.empty() && live_ + cached_ + size > peak_live_) {
        unmap(blocks.back(), it->first);
        blocks.pop_back();
        cached_ -= it->first;
      }
      it = blocks.empty() ? free_.erase(it) : std::next(it);
    }
  }

  void unmap(void* p, size_t size) {
    munmap(p, size);
    sizes_.erase(p);
  }

  static void release(void* ctx) {
    if (ctx == nullptr) return;
    HostPool& pool = self();
    std::lock_guard<std::mutex> lock(pool.mu_);
    const size_t size = pool.sizes_.at(ctx);
    pool.live_ -= size;
    pool.cached_ += size;
    pool.free_[size].push_back(ctx);
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // page-rounded size -> free blocks
  std::unordered_map<void*, size_t> sizes_;               // every mapped block -> its size
  size_t live_ = 0, cached_ = 0, peak_live_ = 0;
  int64_t maps_ = 0, reuses_ = 0;
};

// An uninitialised CPU tensor whose storage allocates (and resizes) through the pool.
at::Tensor empty(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "zeroengine host pool: negative size ", numel);
  return at::detail::empty_generic({numel}, &HostPool::self(),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                   std::nullopt);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "A host-memory pool for the engine's large transient CPU buffers (host_pool.cpp)";
  m.def("empty", &empty, "an uninitialised 1-D CPU tensor whose storage lives in the pool",
        py::arg("numel"), py::arg("dtype"));
  m.def("stats", [] { return HostPool::self().stats(); },
        "live, cached and peak-live bytes of the pool, mappings made and blocks reused");
  m.def("trim", [] { HostPool::self().trim(); }, "unmap every free block");
}
