// A caching CPU allocator with a bound: torch's CPU tensors of at least `min_block` bytes are mapped by us,
// and when freed are kept (up to `max_cached` bytes in all, oldest returned first) for the next request that
// fits. Why (mcore_rl/engine/workers/host_heap.py says more): a training step on CPU allocates and frees
// gigabytes of activation, gradient and logits blocks every step; glibc maps each block above its threshold
// anew and unmaps it on free, so every step page-faults them all in again (0.4 ms per MiB on our VMs, and
// the GEMMs writing fresh pages ran 20-35% slower). Keeping glibc's heap instead (no mmap, no trim) reuses
// the pages but is unbounded: first-fit over one heap fragmented to 14.1 GiB at a 10.4 GiB live peak. Here
// a block is reused only by a request within 1/8 of its size, like CUDA's caching allocator and
// jemalloc/tcmalloc with decay off, so resident memory stays within the live bytes plus `max_cached`.
#include <Python.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>

namespace {

// Every block starts with this header; the tensor's data follows it at c10's 64-byte alignment, and the
// deleter finds the header from the data pointer alone (so the raw allocate/deallocate interface works).
struct alignas(64) Header {
  size_t bytes;    // the whole block, header included
  uint64_t kind;   // which of the two sources it came from
};
constexpr size_t kHeader = sizeof(Header);
constexpr uint64_t kSmall = 0x6d63726c736d616cULL;   // c10::alloc_cpu (glibc's malloc)
constexpr uint64_t kMapped = 0x6d63726c6d617070ULL;  // our own mmap, kept on free
static_assert(kHeader == 64, "the data must keep c10's 64-byte alignment");

void release(void* data);

class HostCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    }
    Header* block = n + kHeader < min_block_.load(std::memory_order_relaxed) ? small(n) : mapped(n);
    void* data = reinterpret_cast<char*>(block) + kHeader;
    // What torch's default CPU allocator reports, so the profiler's memory view (profile_memory=True) and
    // caffe2_report_cpu_memory_usage see our blocks as they would see its own: cheap unless either is on.
    c10::profiledCPUMemoryReporter().New(data, n);
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void free_block(Header* block) {
    if (block->kind == kSmall) {
      c10::free_cpu(block);
      return;
    }
    TORCH_CHECK(block->kind == kMapped, "mcore_rl host cache: a freed block has no header of ours");
    std::lock_guard<std::mutex> lock(mutex_);
    mapped_bytes_ -= block->bytes;
    if (block->bytes > max_cached_) {
      unmap(block);
      return;
    }
    evict_until(max_cached_ - block->bytes);
    by_age_[next_age_] = by_size_.emplace(block->bytes, Cached{block, next_age_});
    ++next_age_;
    cached_bytes_ += block->bytes;
  }

  void configure(size_t max_cached, size_t min_block) {
    std::lock_guard<std::mutex> lock(mutex_);
    max_cached_ = max_cached;
    // Nothing may be kept: every request goes to glibc, exactly as without the cache.
    min_block_.store(max_cached == 0 ? SIZE_MAX : min_block, std::memory_order_relaxed);
    evict_until(max_cached_);
  }

  PyObject* stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "max_cached_bytes", (unsigned long long)max_cached_,
        "min_block_bytes", (unsigned long long)min_block_.load(), "cached_bytes", (unsigned long long)cached_bytes_,
        "mapped_bytes", (unsigned long long)mapped_bytes_, "peak_bytes", (unsigned long long)peak_bytes_,
        "reused", (unsigned long long)reused_, "mapped", (unsigned long long)maps_, "returned_bytes",
        (unsigned long long)returned_bytes_);
  }

 private:
  struct Cached {
    Header* block;
    uint64_t age;
  };
  using BySize = std::multimap<size_t, Cached>;

  static Header* small(size_t n) {
    auto* block = static_cast<Header*>(c10::alloc_cpu(n + kHeader));
    block->bytes = n + kHeader;
    block->kind = kSmall;
    return block;
  }

  Header* mapped(size_t n) {
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t bytes = (n + kHeader + page - 1) / page * page;
    std::lock_guard<std::mutex> lock(mutex_);
    Header* block = take(bytes);
    if (block == nullptr) {
      block = map(bytes);
    }
    mapped_bytes_ += block->bytes;
    peak_bytes_ = std::max(peak_bytes_, mapped_bytes_ + cached_bytes_);
    return block;
  }

  // The smallest kept block of at least `bytes` and at most 1/8 larger (the waste a reuse may carry).
  Header* take(size_t bytes) {
    auto it = by_size_.lower_bound(bytes);
    if (it == by_size_.end() || it->first > bytes + bytes / 8) {
      return nullptr;
    }
    Header* block = it->second.block;
    by_age_.erase(it->second.age);
    by_size_.erase(it);
    cached_bytes_ -= block->bytes;
    ++reused_;
    return block;
  }

  Header* map(size_t bytes) {
    void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {  // what we keep may be what stands in the way: hand it all back, then retry
      evict_until(0);
      base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    TORCH_CHECK(base != MAP_FAILED, "mcore_rl host cache: out of memory mapping ", bytes, " bytes");
    auto* block = static_cast<Header*>(base);
    block->bytes = bytes;
    block->kind = kMapped;
    ++maps_;
    return block;
  }

  void unmap(Header* block) {
    returned_bytes_ += block->bytes;
    munmap(block, block->bytes);
  }

  // Returns the oldest kept blocks to the system until at most `limit` bytes are kept.
  void evict_until(size_t limit) {
    while (cached_bytes_ > limit) {
      auto oldest = by_age_.begin();
      Header* block = oldest->second->second.block;
      cached_bytes_ -= block->bytes;
      by_size_.erase(oldest->second);
      by_age_.erase(oldest);
      unmap(block);
    }
  }

  std::mutex mutex_;
  size_t max_cached_ = 0;
  std::atomic<size_t> min_block_{SIZE_MAX};  // until configured, every request is a c10::alloc_cpu one
  size_t cached_bytes_ = 0;
  size_t mapped_bytes_ = 0;
  size_t peak_bytes_ = 0;
  uint64_t reused_ = 0, maps_ = 0, returned_bytes_ = 0, next_age_ = 0;
  BySize by_size_;
  std::map<uint64_t, BySize::iterator> by_age_;
};

// Never destroyed: tensors may be freed during interpreter shutdown, after static destructors would run.
HostCache* cache() {
  static auto* instance = new HostCache();
  return instance;
}

void release(void* data) {
  if (data != nullptr) {
    c10::profiledCPUMemoryReporter().Delete(data);
    cache()->free_block(reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader));
  }
}

bool installed = false;  // whether torch's CPU allocator is the cache (set under the GIL)

}  // namespace

// _C.host_cache_configure(max_cached_bytes, min_block_bytes): sets the cache's bounds, and on the first
// positive cap installs it as torch's CPU allocator (tensors allocated before keep their own deleters). A
// zero cap before that leaves torch's allocator untouched; after it, the cache keeps nothing and every
// request goes to c10::alloc_cpu, as torch's own allocator does. It stays installed: tensors it allocated
// may still be alive, and each frees through the deleter it was given, whichever allocator is current.
PyObject* mcore_rl_host_cache_configure(PyObject* /*self*/, PyObject* args) {
  unsigned long long max_cached = 0, min_block = 0;
  if (!PyArg_ParseTuple(args, "KK", &max_cached, &min_block)) {
    return nullptr;
  }
  cache()->configure(max_cached, min_block);
  if (!installed && max_cached > 0) {
    c10::SetCPUAllocator(cache(), /*priority=*/1);
    installed = true;
  }
  Py_RETURN_NONE;
}

// _C.host_cache_stats() -> dict of the cache's counters (bytes kept, mapped, peak, reuses, maps, returned)
// and whether it is torch's CPU allocator.
PyObject* mcore_rl_host_cache_stats(PyObject* /*self*/, PyObject* /*args*/) {
  PyObject* stats = cache()->stats();
  if (stats != nullptr && PyDict_SetItemString(stats, "installed", installed ? Py_True : Py_False) != 0) {
    Py_DECREF(stats);
    return nullptr;
  }
  return stats;
}
