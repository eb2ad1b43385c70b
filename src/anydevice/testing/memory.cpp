// The simulated accelerator's device memory: a caching allocator with CUDA's rules.
//
// - Sizes are rounded up to 512 bytes. Requests up to 1 MiB come from 2 MiB segments (the
//   small pool), larger ones from 20 MiB segments (up to 10 MiB) or segments of their own
//   size rounded to 2 MiB (the large pool); a block is split when enough is left over,
//   and merged with its free neighbours when freed. So reserved memory exceeds allocated
//   memory, and fragmentation shows as it does on a GPU.
// - A block belongs to the stream that allocated it. Freed, it goes back to that stream's
//   pool at once: the stream's later work comes after its earlier work anyway. Another
//   stream gets it only after the work queued on the streams given to `record_stream` at
//   the time of the free has completed (polled at later allocations, as CUDA polls its
//   events). A tensor read on another stream without `record_stream` is therefore handed
//   out again while that stream may still read it: the race `record_stream` prevents.
// - Segments go back to the host only on `empty_cache()` or when an allocation would
//   exceed the capacity (then counted as a retry), after the device's streams are
//   waited for (a GPU's cudaFree waits too).
// - Fresh blocks are poisoned (0xFF: NaN in every float type) by a task on the block's
//   stream, after the work queued there that may still use the bytes.
//
// The stream race detector hears of each allocation and free (races.h).

#include "sim.h"

#include "races.h"

#include <c10/core/impl/alloc_cpu.h>

#include <cinttypes>
#include <cstring>
#include <set>
#include <unordered_map>
#include <vector>

namespace anydevice_sim {
namespace {

using Stat = c10::CachingDeviceAllocator::Stat;
using DeviceStats = c10::CachingDeviceAllocator::DeviceStats;

constexpr size_t kMinBlock = 512;  // every size is a multiple of it
constexpr size_t kSmallSize = 1 << 20;  // the largest request served by the small pool
constexpr size_t kSmallBuffer = 2 << 20;  // a small pool segment
constexpr size_t kLargeBuffer = 20 << 20;  // a large pool segment for requests below kMinLargeAlloc
constexpr size_t kMinLargeAlloc = 10 << 20;
constexpr size_t kRoundLarge = 2 << 20;  // larger requests get segments rounded to this

struct Segment;

struct Block {
  c10::DeviceIndex device;
  c10::StreamId stream;
  bool small;
  char* ptr;
  size_t size;
  size_t requested = 0;
  bool allocated = false;
  Segment* segment;
  Block* prev = nullptr;
  Block* next = nullptr;
  std::vector<c10::StreamId> uses;  // record_stream: other streams that read it
};

struct Segment {
  char* base;
  size_t size;
};

struct Order {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) {
      return a->stream < b->stream;
    }
    if (a->size != b->size) {
      return a->size < b->size;
    }
    return a->ptr < b->ptr;
  }
};

using Pool = std::set<Block*, Order>;

// A freed block waiting for the streams it was recorded on.
struct Pending {
  Block* block;
  std::vector<std::pair<Stream*, int64_t>> tickets;
};

size_t round_size(size_t size) {
  return size < kMinBlock ? kMinBlock : kMinBlock * ((size + kMinBlock - 1) / kMinBlock);
}

size_t segment_size(size_t size) {
  if (size <= kSmallSize) {
    return kSmallBuffer;
  }
  if (size < kMinLargeAlloc) {
    return kLargeBuffer;
  }
  return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
}

void count(Stat& stat, int64_t amount) {
  stat.current += amount;
  if (amount > 0) {
    stat.allocated += amount;
  } else {
    stat.freed -= amount;
  }
  stat.peak = std::max(stat.peak, stat.current);
}

std::string mib(int64_t bytes) {
  char text[64];
  snprintf(text, sizeof(text), "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return text;
}

class DeviceMemory;

// One device's pools, blocks and counters.
class Arena {
 public:
  c10::DeviceIndex device = 0;

  Block* malloc(size_t requested, c10::StreamId stream) {
    const size_t size = round_size(requested);
    const bool small = size <= kSmallSize;
    std::unique_lock<std::mutex> lock(mutex_);
    process_pending();
    Block* block = best_fit(small, stream, size);
    if (block == nullptr) {
      block = new_segment(small, stream, segment_size(size), requested);
    }
    pool(small).erase(block);
    if (should_split(block, size)) {
      auto* rest = new Block{device, stream, small, block->ptr + size, block->size - size};
      rest->segment = block->segment;
      rest->prev = block;
      rest->next = block->next;
      if (rest->next != nullptr) {
        rest->next->prev = rest;
      }
      block->next = rest;
      block->size = size;
      pool(small).insert(rest);
    }
    block->allocated = true;
    block->requested = requested;
    live_[block->ptr] = block;
    stat(small, [&](DeviceStats& s, size_t i) {
      count(s.allocation[i], 1);
      count(s.allocated_bytes[i], static_cast<int64_t>(block->size));
      count(s.requested_bytes[i], static_cast<int64_t>(requested));
      count(s.active[i], 1);
      count(s.active_bytes[i], static_cast<int64_t>(block->size));
    });
    return block;
  }

  void free(Block* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.erase(block->ptr);
    block->allocated = false;
    stat(block->small, [&](DeviceStats& s, size_t i) {
      count(s.allocation[i], -1);
      count(s.allocated_bytes[i], -static_cast<int64_t>(block->size));
      count(s.requested_bytes[i], -static_cast<int64_t>(block->requested));
    });
    if (block->uses.empty()) {
      release(block);
      return;
    }
    // Reused only after what the recorded streams queued until now (CUDA records an
    // event on each of them here).
    Pending p{block, {}};
    for (c10::StreamId id : block->uses) {
      Stream& s = stream_of(device, id);
      p.tickets.emplace_back(&s, s.submitted());
    }
    block->uses.clear();
    pending_.push_back(std::move(p));
  }

  void record_stream(Block* block, c10::StreamId id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (id != block->stream &&
        std::find(block->uses.begin(), block->uses.end(), id) == block->uses.end()) {
      block->uses.push_back(id);
    }
  }

  Block* find(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(const_cast<void*>(ptr));
    return it == live_.end() ? nullptr : it->second;
  }

  // Give every unused segment back, after the device's streams are done with them.
  void release_cached() {
    std::lock_guard<std::mutex> lock(mutex_);
    release_cached_locked();
  }

  DeviceStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    update_inactive();
    return stats_;
  }

  void reset_accumulated() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* arr : arrays()) {
      for (auto& stat : *arr) {
        stat.allocated = 0;
        stat.freed = 0;
      }
    }
    stats_.num_alloc_retries = stats_.num_ooms = stats_.num_sync_all_streams = 0;
    stats_.num_device_alloc = stats_.num_device_free = 0;
  }

  void reset_peaks() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* arr : arrays()) {
      for (auto& stat : *arr) {
        stat.peak = stat.current;
      }
    }
  }

  int64_t reserved() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_.reserved_bytes[0].current;
  }

 private:
  Pool& pool(bool small) { return small ? small_ : large_; }

  template <typename F>
  void stat(bool small, F&& f) {
    f(stats_, 0);
    f(stats_, small ? 1 : 2);
  }

  std::vector<c10::CachingDeviceAllocator::StatArray*> arrays() {
    auto& s = stats_;
    return {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
            &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes};
  }

  Block* best_fit(bool small, c10::StreamId stream, size_t size) {
    Block key{device, stream, small, nullptr, size};
    auto it = pool(small).lower_bound(&key);
    if (it == pool(small).end() || (*it)->stream != stream) {
      return nullptr;
    }
    return *it;
  }

  static bool should_split(const Block* block, size_t size) {
    const size_t rest = block->size - size;
    return block->small ? rest >= kMinBlock : rest > kSmallSize;
  }

  Block* new_segment(bool small, c10::StreamId stream, size_t bytes, size_t requested) {
    const int64_t capacity = g_capacity.load();
    auto fits = [&] { return capacity < 0 || stats_.reserved_bytes[0].current + static_cast<int64_t>(bytes) <= capacity; };
    if (!fits()) {
      stats_.num_alloc_retries += 1;
      release_cached_locked();
    }
    if (!fits()) {
      stats_.num_ooms += 1;
      const int64_t allocated = stats_.allocated_bytes[0].current;
      const int64_t reserved = stats_.reserved_bytes[0].current;
      TORCH_CHECK_WITH(
          OutOfMemoryError, false, "anydevice simulator: out of memory on device ",
          static_cast<int>(device), ". Tried to allocate ", mib(static_cast<int64_t>(requested)),
          ". The device has ", mib(capacity), " in all (the capacity set by "
          "anydevice.testing.enable(capacity=...)), of which ", mib(capacity - reserved),
          " is free. Of the memory reserved by PyTorch, ", mib(allocated),
          " is allocated and ", mib(reserved - allocated),
          " is reserved but unallocated (cached blocks, which other allocation sizes or "
          "streams cannot use; torch.accelerator.empty_cache() gives them back).");
    }
    char* base = static_cast<char*>(c10::alloc_cpu(bytes));
    auto* segment = new Segment{base, bytes};
    auto* block = new Block{device, stream, small, base, bytes};
    block->segment = segment;
    pool(small).insert(block);
    stat(small, [&](DeviceStats& s, size_t i) {
      count(s.segment[i], 1);
      count(s.reserved_bytes[i], static_cast<int64_t>(bytes));
    });
    stats_.num_device_alloc += 1;
    return block;
  }

  // A free block goes back to its pool, merged with free neighbours.
  void release(Block* block) {
    stat(block->small, [&](DeviceStats& s, size_t i) {
      count(s.active[i], -1);
      count(s.active_bytes[i], -static_cast<int64_t>(block->size));
    });
    for (Block* other : {block->prev, block->next}) {
      if (other == nullptr || other->allocated || is_pending(other)) {
        continue;
      }
      pool(block->small).erase(other);
      if (other == block->prev) {
        block->ptr = other->ptr;
        block->prev = other->prev;
        if (block->prev != nullptr) {
          block->prev->next = block;
        }
      } else {
        block->next = other->next;
        if (block->next != nullptr) {
          block->next->prev = block;
        }
      }
      block->size += other->size;
      delete other;
    }
    pool(block->small).insert(block);
  }

  bool is_pending(const Block* block) const {
    for (const auto& p : pending_) {
      if (p.block == block) {
        return true;
      }
    }
    return false;
  }

  void process_pending() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool done = true;
      for (auto& [stream, ticket] : it->tickets) {
        done = done && stream->completed_at_least(ticket);
      }
      if (done) {
        Block* block = it->block;
        it = pending_.erase(it);
        release(block);
      } else {
        ++it;
      }
    }
  }

  void release_cached_locked() {
    for (int id = 0; id < kStreams; ++id) {
      stream_of(device, static_cast<c10::StreamId>(id)).drain();  // queued work may use cached bytes
    }
    stats_.num_sync_all_streams += 1;
    process_pending();
    for (Pool* p : {&small_, &large_}) {
      for (auto it = p->begin(); it != p->end();) {
        Block* block = *it;
        if (block->prev != nullptr || block->next != nullptr) {
          ++it;  // part of a segment still in use
          continue;
        }
        it = p->erase(it);
        stat(block->small, [&](DeviceStats& s, size_t i) {
          count(s.segment[i], -1);
          count(s.reserved_bytes[i], -static_cast<int64_t>(block->size));
        });
        stats_.num_device_free += 1;
        c10::free_cpu(block->segment->base);
        delete block->segment;
        delete block;
      }
    }
  }

  // Free blocks inside segments that are still partly in use.
  void update_inactive() {
    int64_t blocks[3] = {0, 0, 0}, bytes[3] = {0, 0, 0};
    for (Pool* p : {&small_, &large_}) {
      for (const Block* b : *p) {
        if (b->prev != nullptr || b->next != nullptr) {
          const size_t i = b->small ? 1 : 2;
          blocks[0] += 1;
          blocks[i] += 1;
          bytes[0] += static_cast<int64_t>(b->size);
          bytes[i] += static_cast<int64_t>(b->size);
        }
      }
    }
    for (size_t i = 0; i < 3; ++i) {
      count(stats_.inactive_split[i], blocks[i] - stats_.inactive_split[i].current);
      count(stats_.inactive_split_bytes[i], bytes[i] - stats_.inactive_split_bytes[i].current);
    }
  }

  std::mutex mutex_;
  Pool small_, large_;
  std::unordered_map<void*, Block*> live_;
  std::vector<Pending> pending_;
  DeviceStats stats_;
};

std::array<Arena, kMaxDevices>& arenas() {
  static auto* all = [] {
    auto* a = new std::array<Arena, kMaxDevices>();  // never destroyed: frees at exit
    for (int i = 0; i < kMaxDevices; ++i) {
      (*a)[static_cast<size_t>(i)].device = static_cast<c10::DeviceIndex>(i);
    }
    return a;
  }();
  return *all;
}

bool watched() {
  auto& d = anydevice_races::detector();
  return d.active() && d.type() == kDev && d.simulated();
}

void release(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  const c10::Stream stream = make_stream(block->device, block->stream);
  const void* ptr = block->ptr;
  const size_t size = block->size;
  arenas()[static_cast<size_t>(block->device)].free(block);
  if (watched() && anydevice_races::detector().freed(ptr, size, stream)) {
    anydevice_races::detector().freed_at(ptr, anydevice_races::capture_site());
  }
}

class DeviceMemory final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    return anydevice_sim::allocate(t_device, bytes);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override { return true; }

  void emptyCache(c10::MempoolId_t /*unused*/) override {
    for (int d = 0; d < g_device_count.load(); ++d) {
      arenas()[static_cast<size_t>(d)].release_cached();
    }
  }

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    if (ptr.get_deleter() != &release || ptr.get_context() == nullptr) {
      return;
    }
    auto* block = static_cast<Block*>(ptr.get_context());
    arenas()[static_cast<size_t>(block->device)].record_stream(block, stream.id());
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_index(device);
    return arenas()[static_cast<size_t>(device)].stats();
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_index(device);
    arenas()[static_cast<size_t>(device)].reset_accumulated();
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_index(device);
    arenas()[static_cast<size_t>(device)].reset_peaks();
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_index(device);
    const int64_t capacity = g_capacity.load();
    const int64_t total = capacity >= 0 ? capacity : host_memory();
    const int64_t used = arenas()[static_cast<size_t>(device)].reserved();
    return {static_cast<size_t>(std::max<int64_t>(total - used, 0)), static_cast<size_t>(total)};
  }
};

}  // namespace

c10::DeviceAllocator* device_allocator() {
  static auto* memory = new DeviceMemory();  // never destroyed: frees at exit
  return memory;
}

thread_local bool t_unpoisoned = false;

c10::DataPtr allocate(c10::DeviceIndex device, size_t bytes) {
  check_index(device);
  g_started = true;
  const c10::Device where(kDev, device);
  if (bytes == 0) {
    return {nullptr, nullptr, &release, where};
  }
  const c10::StreamId stream = t_stream[static_cast<size_t>(device)];
  Block* block = arenas()[static_cast<size_t>(device)].malloc(bytes, stream);
  char* data = block->ptr;
  const size_t size = block->size;
  // The poison, after the work the stream queued before (it may still use these bytes).
  if (!t_unpoisoned) {
    stream_of(device, stream).enqueue([data, size] { std::memset(data, 0xFF, size); }, "poison");
  }
  if (watched()) {
    anydevice_races::detector().allocated(data, size, make_stream(device, stream));
  }
  return {data, block, &release, where};
}

c10::DeviceIndex device_of_ptr(const void* ptr) {
  for (int d = 0; d < g_device_count.load(); ++d) {
    if (arenas()[static_cast<size_t>(d)].find(ptr) != nullptr) {
      return static_cast<c10::DeviceIndex>(d);
    }
  }
  return -1;
}

}  // namespace anydevice_sim
