// Asynchronous file I/O for NVMe offload: reads and writes of tensors to files, split into
// block_size requests kept queue_depth deep, completing in the background.
//
// Backends, chosen at build time (setup.py) and reported by backend():
// - "io_uring" (liburing): one submission thread per engine owns a ring; it keeps up to
//   queue_depth block requests in flight across all pending transfers and reaps completions;
// - "threads": thread_count workers doing pread/pwrite on blocks (any POSIX system).
// O_DIRECT (bypassing the page cache, as DeepSpeed's aio does) is used when asked and the
// buffer, offset and length are 4096-aligned; otherwise the file is opened buffered.
// Every transfer gets an id; wait(id) blocks until all its blocks are done and raises the
// first error (with the path and offset) if any block failed.
#include <torch/extension.h>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#ifdef ZE_HAVE_LIBURING
#include <liburing.h>
#endif

namespace {

constexpr int64_t kAlign = 4096;

struct Transfer {
  int fd = -1;
  bool write = false;
  std::string path;
  std::atomic<int64_t> blocks_left{0};
  std::mutex mu;
  std::string error;  // first failure
  // The buffer stays alive until the transfer is waited for. Released by wait() (a Python
  // thread), never by the I/O thread: the last reference to a tensor Python made takes the
  // GIL to free it, and an I/O thread blocked on the GIL stalls every transfer behind it - for
  // good while the GIL holder waits for that thread (~Engine's join: a deadlock).
  at::Tensor keep;
};

struct Block {
  std::shared_ptr<Transfer> t;
  char* buf;
  int64_t len;
  int64_t offset;
};

class Engine {
 public:
  Engine(int64_t block_size, int64_t queue_depth, int64_t thread_count, bool o_direct)
      : block_(block_size), depth_(queue_depth), direct_(o_direct) {
    TORCH_CHECK(block_size > 0 && block_size % kAlign == 0,
                "block_size must be a positive multiple of 4096, got ", block_size);
    TORCH_CHECK(queue_depth > 0, "queue_depth must be positive");
#ifdef ZE_HAVE_LIBURING
    const int rc = io_uring_queue_init(static_cast<unsigned>(queue_depth), &ring_, 0);
    TORCH_CHECK(rc == 0, "io_uring_queue_init failed: ", std::strerror(-rc));
    workers_.emplace_back([this] { uring_loop(); });
    (void)thread_count;
#else
    TORCH_CHECK(thread_count > 0, "thread_count must be positive");
    for (int64_t i = 0; i < thread_count; ++i) workers_.emplace_back([this] { thread_loop(); });
#endif
  }

  ~Engine() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
#ifdef ZE_HAVE_LIBURING
    io_uring_queue_exit(&ring_);
#endif
    for (auto& kv : fds_) ::close(kv.second);
  }

  static std::string backend() {
#ifdef ZE_HAVE_LIBURING
    return "io_uring";
#else
    return "threads";
#endif
  }

  // Start reading (write=false) or writing the bytes of `buffer` at `offset` of `path`.
  int64_t submit(at::Tensor buffer, const std::string& path, int64_t offset, bool write) {
    TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(),
                "aio buffers must be contiguous CPU tensors");
    TORCH_CHECK(offset >= 0, "offset must be >= 0");
    const int64_t nbytes = buffer.numel() * buffer.element_size();
    char* base = static_cast<char*>(buffer.data_ptr());
    const bool aligned = reinterpret_cast<uintptr_t>(base) % kAlign == 0 &&
                         offset % kAlign == 0 && nbytes % kAlign == 0;
    auto t = std::make_shared<Transfer>();
    t->write = write;
    t->path = path;
    t->keep = buffer;
    t->fd = open_file(path, write, direct_ && aligned);
    const int64_t blocks = nbytes == 0 ? 0 : (nbytes + block_ - 1) / block_;
    t->blocks_left = blocks;
    int64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = next_id_++;
      transfers_[id] = t;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t lo = b * block_;
        queue_.push_back(Block{t, base + lo, std::min(block_, nbytes - lo), offset + lo});
      }
    }
    cv_.notify_all();
    return id;
  }

  bool done(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = transfers_.find(id);
    return it == transfers_.end() || it->second->blocks_left.load() == 0;
  }

  void wait(int64_t id) {
    std::shared_ptr<Transfer> t;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto it = transfers_.find(id);
      TORCH_CHECK(it != transfers_.end(), "unknown or already waited aio request ", id);
      t = it->second;
      done_cv_.wait(lock, [&] { return t->blocks_left.load() == 0; });
      transfers_.erase(it);
    }
    at::Tensor keep;  // every block is done: the buffer is free here, on this thread
    std::string error;
    {
      std::lock_guard<std::mutex> lock(t->mu);
      keep = std::move(t->keep);
      error = t->error;
    }
    TORCH_CHECK(error.empty(), error);
  }

  // fsync every file this engine wrote: after it, the bytes are on the device.
  void sync_files() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : fds_)
      if (kv.first.back() == 'w') TORCH_CHECK(::fsync(kv.second) == 0, "fsync failed");
  }

  void forget(const std::string& path) {  // close the file (before deleting or renaming it)
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = fds_.begin(); it != fds_.end();) {
      if (it->first.compare(0, it->first.size() - 2, path) == 0 &&
          it->first.size() == path.size() + 2) {
        ::close(it->second);
        it = fds_.erase(it);
      } else {
        ++it;
      }
    }
  }

 private:
  int open_file(const std::string& path, bool write, bool direct) {
    // one descriptor per (path, direction, direct): reused across transfers
    const std::string key = path + (direct ? "d" : "b") + (write ? "w" : "r");
    std::lock_guard<std::mutex> lock(mu_);
    auto it = fds_.find(key);
    if (it != fds_.end()) return it->second;
    int flags = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
    if (direct) flags |= O_DIRECT;
    const int fd = ::open(path.c_str(), flags, 0600);
    TORCH_CHECK(fd >= 0, "cannot open ", path, " for ", write ? "writing" : "reading", ": ",
                std::strerror(errno));
    fds_[key] = fd;
    return fd;
  }

  void finish_block(const Block& b, int64_t result) {
    if (result != b.len) {
      std::lock_guard<std::mutex> lock(b.t->mu);
      if (b.t->error.empty())
        b.t->error = std::string(b.t->write ? "write to " : "read from ") + b.t->path +
                     " at offset " + std::to_string(b.offset) + " failed: " +
                     (result < 0 ? std::strerror(static_cast<int>(-result))
                                 : "short transfer (" + std::to_string(result) + " of " +
                                       std::to_string(b.len) + " bytes; file too short?)");
    }
    if (b.t->blocks_left.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_all();
    }
  }

  static int64_t transfer_now(const Block& b) {  // one block, synchronously, whole
    int64_t done = 0;
    while (done < b.len) {
      const ssize_t r = b.t->write ? ::pwrite(b.t->fd, b.buf + done, b.len - done, b.offset + done)
                                   : ::pread(b.t->fd, b.buf + done, b.len - done, b.offset + done);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return -errno;
      if (r == 0) break;
      done += r;
    }
    return done;
  }

  void thread_loop() {
    for (;;) {
      Block b;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
        b = queue_.front();
        queue_.pop_front();
      }
      finish_block(b, transfer_now(b));
    }
  }

#ifdef ZE_HAVE_LIBURING
  void uring_loop() {
    std::vector<std::unique_ptr<Block>> slots;  // in flight, owned here
    int64_t in_flight = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (in_flight == 0) cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty() && in_flight == 0) return;
        int64_t added = 0;
        while (!queue_.empty() && in_flight < depth_) {
          io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
          if (sqe == nullptr) break;
          auto* b = new Block(queue_.front());
          queue_.pop_front();
          if (b->t->write) {
            io_uring_prep_write(sqe, b->t->fd, b->buf, static_cast<unsigned>(b->len), b->offset);
          } else {
            io_uring_prep_read(sqe, b->t->fd, b->buf, static_cast<unsigned>(b->len), b->offset);
          }
          io_uring_sqe_set_data(sqe, b);
          ++in_flight;
          ++added;
        }
        if (added) io_uring_submit(&ring_);
      }
      if (in_flight == 0) continue;
      io_uring_cqe* cqe = nullptr;
      if (io_uring_wait_cqe(&ring_, &cqe) < 0) continue;
      do {
        std::unique_ptr<Block> b(static_cast<Block*>(io_uring_cqe_get_data(cqe)));
        int64_t result = cqe->res;
        io_uring_cqe_seen(&ring_, cqe);
        --in_flight;
        if (result >= 0 && result < b->len) {  // short: finish the rest synchronously
          Block rest{b->t, b->buf + result, b->len - result, b->offset + result};
          const int64_t more = result > 0 ? transfer_now(rest) : 0;
          result = more < 0 ? more : result + more;
        }
        finish_block(*b, result);
      } while (io_uring_peek_cqe(&ring_, &cqe) == 0);
    }
  }
  io_uring ring_;
#endif

  const int64_t block_, depth_;
  const bool direct_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Block> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Transfer>> transfers_;
  std::unordered_map<std::string, int> fds_;
  std::vector<std::thread> workers_;
  int64_t next_id_ = 1;
  bool stop_ = false;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine asynchronous file I/O (NVMe offload): io_uring or a thread pool";
  py::class_<Engine>(m, "Engine")
      .def(py::init<int64_t, int64_t, int64_t, bool>(), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("thread_count"), py::arg("o_direct"))
      .def("submit", &Engine::submit, py::arg("buffer"), py::arg("path"), py::arg("offset"),
           py::arg("write"), py::call_guard<py::gil_scoped_release>())
      .def("wait", &Engine::wait, py::arg("id"), py::call_guard<py::gil_scoped_release>())
      .def("done", &Engine::done, py::arg("id"))
      .def("sync_files", &Engine::sync_files, py::call_guard<py::gil_scoped_release>())
      .def("forget", &Engine::forget, py::arg("path"))
      .def_static("backend", &Engine::backend);
}
