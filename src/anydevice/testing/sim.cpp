// A simulated asynchronous accelerator for torch's privateuse1 slot.
//
// It behaves like a GPU in the ways that hide bugs on a CPU-only machine:
//
// - Its memory is its own. Every allocation starts poisoned (all bytes 0xFF: NaN for
//   every IEEE float type, -1 for signed integers; bool tensors get 0x01, true), so a
//   read that comes before the write shows.
// - Every stream is a queue run in order by a worker thread of its own. Work queued on a
//   stream returns to the host at once; the host sees its effect only after it waits
//   (stream or event synchronisation, or a blocking copy).
// - Copies between host and device cross a link with a speed: the worker sleeps
//   bytes / bandwidth, then moves the bytes. Data lands at the END of that time, so
//   whoever reads early reads the poison (or the old values).
// - Kernels run on the host through torch's CPU kernels, on the device memory itself
//   (the simulated device's memory is host memory). Before a kernel runs, the host waits
//   for the current stream of each device the kernel touches: a kernel is ordered after
//   everything queued on its stream, as on a GPU, and after nothing else.
//
// The host reaches device data only through copies (and kernels): there is no other
// path from a device pointer to Python.

#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace anydevice_sim {

using Clock = std::chrono::steady_clock;
constexpr c10::DeviceType kDev = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 16;
// Stream 0 is each device's default stream; 1.. are the pool torch hands out for
// torch.Stream(): created round-robin, like CUDA's pool, so a program that makes streams
// in a loop does not make threads without end.
constexpr int kStreams = 32;

// ---------------------------------------------------------------------------
// Settings, fixed (device count) or changeable at run time (bandwidth, capacity).

std::atomic<int> g_device_count{1};
std::atomic<bool> g_started{false};  // the device count is fixed once anything ran
std::atomic<double> g_bandwidth{2e9};  // bytes per second, each direction
std::atomic<int64_t> g_capacity{-1};  // bytes per device; -1: the host's memory

thread_local c10::DeviceIndex t_device = 0;
thread_local std::array<c10::StreamId, kMaxDevices> t_stream{};  // 0: the default stream

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(
      index >= 0 && index < g_device_count.load(),
      "anydevice simulator: device index ", static_cast<int>(index),
      " is out of range (", g_device_count.load(), " device(s))");
}

// ---------------------------------------------------------------------------
// Streams: a queue and the worker thread that runs it.

class Stream {
 public:
  // Queue a task; returns its ticket (its place in the queue, from 1).
  int64_t enqueue(std::function<void()> task) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!worker_started_) {
      // Detached: the process may end with tasks queued or a worker asleep; streams are
      // never destroyed, so the worker never outlives what it uses.
      std::thread([this] { run(); }).detach();
      worker_started_ = true;
    }
    queue_.emplace_back(std::move(task));
    ++submitted_;
    work_.notify_one();
    return submitted_;
  }

  // The host waits for every task queued up to `ticket`.
  void wait(int64_t ticket) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return completed_ >= ticket; });
  }

  // The host waits for everything queued so far.
  void synchronize() {
    int64_t ticket;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ticket = submitted_;
    }
    wait(ticket);
  }

  bool query() {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ >= submitted_;
  }

 private:
  void run() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_.wait(lock, [&] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        task();
      } catch (const std::exception& e) {
        // A failed task is a failed kernel on a GPU: reported, and the stream goes on.
        fprintf(stderr, "anydevice simulator: a queued task failed: %s\n", e.what());
      }
      // Drop what the task holds (the tensors of a copy) before it counts as done, so
      // memory counters read after a synchronisation do not still include them.
      task = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++completed_;
      }
      done_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::deque<std::function<void()>> queue_;
  int64_t submitted_ = 0, completed_ = 0;
  bool worker_started_ = false;
};

Stream& stream_of(c10::DeviceIndex device, c10::StreamId id) {
  check_index(device);
  TORCH_CHECK(id >= 0 && id < kStreams, "anydevice simulator: unknown stream id ", id);
  // Never destroyed (see Stream::enqueue): made on first use, then kept.
  static std::array<std::array<std::atomic<Stream*>, kStreams>, kMaxDevices> streams{};
  static std::mutex made;
  std::atomic<Stream*>& slot = streams[device][id];
  Stream* s = slot.load();
  if (s == nullptr) {
    std::lock_guard<std::mutex> lock(made);
    s = slot.load();
    if (s == nullptr) {
      s = new Stream();
      slot.store(s);
    }
  }
  g_started = true;
  return *s;
}

c10::Stream make_stream(c10::DeviceIndex device, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, device), id);
}

Stream& current_stream(c10::DeviceIndex device) {
  return stream_of(device, t_stream[device]);
}

void synchronize_device(c10::DeviceIndex device) {
  for (int id = 0; id < kStreams; ++id) {
    stream_of(device, id).synchronize();
  }
}

// ---------------------------------------------------------------------------
// A trace of the work the workers did (copies over the link, busy time), kept while
// switched on, so tests can check ordering facts (what overlapped what) on the workers'
// own clock rather than on wall-clock thresholds.

struct Span {
  std::string what;  // "h2d", "d2h" or "busy"
  int device;
  int64_t stream;
  int64_t bytes;
  double start, end;  // seconds on the steady clock (time.monotonic's clock on Linux)
};

std::atomic<bool> g_tracing{false};
std::mutex g_trace_mutex;
std::vector<Span> g_trace;

double seconds_of(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

void trace(std::string what, int device, int64_t stream, int64_t bytes,
           Clock::time_point start, Clock::time_point end) {
  if (g_tracing.load()) {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    g_trace.push_back({std::move(what), device, stream, bytes, seconds_of(start), seconds_of(end)});
  }
}

// ---------------------------------------------------------------------------
// The link: one per device and direction, like a GPU's copy engines. Transfers in the
// same direction share it (one after the other); each takes bytes / bandwidth.

struct Link {
  std::mutex mutex;
  Clock::time_point free_at{};
};

Link& link_of(c10::DeviceIndex device, bool to_device) {
  static std::array<std::array<Link, 2>, kMaxDevices> links;
  return links[device][to_device ? 1 : 0];
}

// Called by a stream's worker: sleeps for the transfer's time on the link.
void cross_link(c10::DeviceIndex device, bool to_device, size_t bytes, int64_t stream) {
  const double bandwidth = g_bandwidth.load();
  if (bandwidth <= 0 || bytes == 0) {
    const auto now = Clock::now();
    trace(to_device ? "h2d" : "d2h", device, stream, bytes, now, now);
    return;
  }
  const auto seconds = std::chrono::duration<double>(static_cast<double>(bytes) / bandwidth);
  Clock::time_point start, end;
  {
    Link& link = link_of(device, to_device);
    std::lock_guard<std::mutex> lock(link.mutex);
    start = std::max(Clock::now(), link.free_at);
    end = start + std::chrono::duration_cast<Clock::duration>(seconds);
    link.free_at = end;
  }
  std::this_thread::sleep_until(end);
  trace(to_device ? "h2d" : "d2h", device, stream, bytes, start, end);
}

// ---------------------------------------------------------------------------
// Events: recorded by a stream's worker when it reaches them, with the worker's clock.

struct Event {
  std::mutex mutex;
  std::condition_variable cv;
  int64_t scheduled = 0;  // versions queued by record()
  int64_t reached = 0;  // the newest version a worker reached
  Clock::time_point when{};
  bool timing = false;
};

// What torch holds as the event's void*: one owner of the shared event, so a task still
// queued when torch destroys the event keeps it alive.
struct EventHandle {
  std::shared_ptr<Event> event;
};

Event& event_of(void* handle) {
  return *static_cast<EventHandle*>(handle)->event;
}

// ---------------------------------------------------------------------------
// Device memory: poisoned allocations, torch's counters, a capacity.

struct Allocation {
  size_t bytes;
  c10::DeviceIndex device;
};

int64_t host_memory() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}

void count(c10::CachingDeviceAllocator::Stat& stat, int64_t amount) {
  stat.current += amount;
  if (amount > 0) {
    stat.allocated += amount;
  } else {
    stat.freed -= amount;
  }
  stat.peak = std::max(stat.peak, stat.current);
}

class DeviceMemory final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    const c10::DeviceIndex device = t_device;
    check_index(device);
    g_started = true;
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const int64_t in_use = stats_[device].allocated_bytes[0].current;
      const int64_t capacity = g_capacity.load();
      TORCH_CHECK_WITH(
          OutOfMemoryError,
          capacity < 0 || in_use + static_cast<int64_t>(bytes) <= capacity,
          "anydevice simulator: out of memory on device ", static_cast<int>(device),
          ": tried to allocate ", bytes, " bytes with ", in_use, " of ", capacity,
          " bytes in use (the capacity set by anydevice.testing.enable(capacity=...))");
      if (bytes > 0) {
        data = c10::alloc_cpu(bytes);
        live_[data] = Allocation{bytes, device};
        auto& s = stats_[device];
        for (auto* stat : {&s.allocated_bytes[0], &s.reserved_bytes[0], &s.active_bytes[0],
                           &s.requested_bytes[0]}) {
          count(*stat, static_cast<int64_t>(bytes));
        }
        for (auto* stat : {&s.allocation[0], &s.segment[0], &s.active[0]}) {
          count(*stat, 1);
        }
        s.num_device_alloc += 1;
      }
    }
    if (data != nullptr) {
      std::memset(data, 0xFF, bytes);  // the poison: NaN in every float type
    }
    return {data, data, &DeviceMemory::release, c10::Device(kDev, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &DeviceMemory::release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override {
    return true;
  }
  // Nothing is cached: a freed block goes back to the host at once, so there is no
  // cache to empty and no reuse across streams to guard against.
  void emptyCache(c10::MempoolId_t /*unused*/) override {}
  void recordStream(const c10::DataPtr& /*unused*/, c10::Stream /*unused*/) override {}

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_[device];
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = stats_[device];
    for (auto* arr : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes,
                      &s.reserved_bytes, &s.active_bytes, &s.requested_bytes}) {
      for (auto& stat : *arr) {
        stat.allocated = 0;
        stat.freed = 0;
      }
    }
    s.num_device_alloc = 0;
    s.num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = stats_[device];
    for (auto* arr : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes,
                      &s.reserved_bytes, &s.active_bytes, &s.requested_bytes}) {
      for (auto& stat : *arr) {
        stat.peak = stat.current;
      }
    }
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_index(device);
    const int64_t capacity = g_capacity.load();
    const int64_t total = capacity >= 0 ? capacity : host_memory();
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t used = stats_[device].allocated_bytes[0].current;
    return {static_cast<size_t>(std::max<int64_t>(total - used, 0)), static_cast<size_t>(total)};
  }

  // The device a pointer belongs to, or -1.
  c10::DeviceIndex device_of(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(const_cast<void*>(ptr));
    return it == live_.end() ? -1 : it->second.device;
  }

  static void release(void* data);

 private:
  void free_block(void* data) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(data);
      if (it == live_.end()) {
        return;
      }
      const auto [bytes, device] = it->second;
      live_.erase(it);
      auto& s = stats_[device];
      for (auto* stat : {&s.allocated_bytes[0], &s.reserved_bytes[0], &s.active_bytes[0],
                         &s.requested_bytes[0]}) {
        count(*stat, -static_cast<int64_t>(bytes));
      }
      for (auto* stat : {&s.allocation[0], &s.segment[0], &s.active[0]}) {
        count(*stat, -1);
      }
      s.num_device_free += 1;
    }
    c10::free_cpu(data);
  }

  std::mutex mutex_;
  std::unordered_map<void*, Allocation> live_;
  std::array<c10::CachingDeviceAllocator::DeviceStats, kMaxDevices> stats_{};
};

DeviceMemory g_memory;
void DeviceMemory::release(void* data) {
  g_memory.free_block(data);
}
REGISTER_ALLOCATOR(kDev, &g_memory)

// Pinned host memory: ordinary host memory this backend knows as pinned, so copies from
// it (and to it) may run asynchronously, as page-locked memory does on a GPU.
class PinnedMemory final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    void* data = bytes > 0 ? c10::alloc_cpu(bytes) : nullptr;
    if (data != nullptr) {
      // Poisoned too: a pinned buffer read before its device-to-host copy landed shows
      // NaN, where a reused buffer on a GPU shows an older batch.
      std::memset(data, 0xFF, bytes);
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[reinterpret_cast<uintptr_t>(data)] = bytes;
    }
    return {data, data, &PinnedMemory::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &PinnedMemory::release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // Whether ptr lies inside a pinned block (a view into one is pinned too).
  bool contains(const void* ptr) {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) {
      return false;
    }
    --it;
    return p < it->first + it->second;
  }

  static void release(void* data);

 private:
  void forget(void* data) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.erase(reinterpret_cast<uintptr_t>(data));
    }
    c10::free_cpu(data);
  }

  std::mutex mutex_;
  std::map<uintptr_t, size_t> blocks_;
};

PinnedMemory g_pinned;
void PinnedMemory::release(void* data) {
  g_pinned.forget(data);
}

bool is_pinned(const at::Tensor& t) {
  return t.is_cpu() && t.storage().data() != nullptr && g_pinned.contains(t.storage().data());
}

// ---------------------------------------------------------------------------
// The device guard: current device, streams, events, for torch's device-generic API.

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kDev;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(kDev, t_device);
  }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    t_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    t_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override {
    const auto index = d.has_index() ? d.index() : t_device;
    return make_stream(index, t_stream[index]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return make_stream(d.has_index() ? d.index() : t_device, 0);
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return from_pool(d);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high*/) const override {
    return from_pool(d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    const auto index = s.device_index();
    auto old = make_stream(index, t_stream[index]);
    t_stream[index] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_device_count.load());
  }

  // Recording queues a task: the event is reached when the stream's worker gets to it,
  // after everything queued before it, and it takes the worker's clock at that moment.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "anydevice simulator: an event of device ", static_cast<int>(device_index),
                " cannot be recorded on a stream of device ",
                static_cast<int>(stream.device_index()));
    if (*event == nullptr) {
      auto* handle = new EventHandle{std::make_shared<Event>()};
      // torch.Event(enable_timing=True) asks for the backend's default: timing events.
      handle->event->timing = flag == c10::EventFlag::BACKEND_DEFAULT;
      *event = handle;
    }
    std::shared_ptr<Event> ev = static_cast<EventHandle*>(*event)->event;
    int64_t version;
    {
      std::lock_guard<std::mutex> lock(ev->mutex);
      version = ++ev->scheduled;
    }
    stream_of(stream.device_index(), stream.id()).enqueue([ev, version] {
      {
        std::lock_guard<std::mutex> lock(ev->mutex);
        ev->when = Clock::now();
        ev->reached = std::max(ev->reached, version);
      }
      ev->cv.notify_all();
    });
  }

  // A wait queued on the stream: its worker stops there until the event's newest
  // recorded version (at the time of this call) is reached. The host does not wait.
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) {
      return;  // never recorded: nothing to wait for, as on CUDA
    }
    std::shared_ptr<Event> ev = static_cast<EventHandle*>(event)->event;
    int64_t version;
    {
      std::lock_guard<std::mutex> lock(ev->mutex);
      version = ev->scheduled;
    }
    stream_of(stream.device_index(), stream.id()).enqueue([ev, version] {
      std::unique_lock<std::mutex> lock(ev->mutex);
      ev->cv.wait(lock, [&] { return ev->reached >= version; });
    });
  }

  bool queryEvent(void* event) const override {
    if (event == nullptr) {
      return true;
    }
    Event& ev = event_of(event);
    std::lock_guard<std::mutex> lock(ev.mutex);
    return ev.reached >= ev.scheduled;
  }

  void synchronizeEvent(void* event) const override {
    if (event == nullptr) {
      return;
    }
    Event& ev = event_of(event);
    std::unique_lock<std::mutex> lock(ev.mutex);
    const int64_t version = ev.scheduled;
    ev.cv.wait(lock, [&] { return ev.reached >= version; });
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device*/) const override {
    TORCH_CHECK(start != nullptr && end != nullptr,
                "anydevice simulator: both events must be recorded before elapsed_time");
    Event& a = event_of(start);
    Event& b = event_of(end);
    Clock::time_point ta, tb;
    {
      std::lock_guard<std::mutex> lock(a.mutex);
      TORCH_CHECK(a.timing, "anydevice simulator: the start event was made without timing "
                            "(torch.Event(enable_timing=True))");
      TORCH_CHECK(a.reached >= a.scheduled && a.reached > 0,
                  "anydevice simulator: the start event has not been reached yet; "
                  "synchronize it before elapsed_time");
      ta = a.when;
    }
    {
      std::lock_guard<std::mutex> lock(b.mutex);
      TORCH_CHECK(b.timing, "anydevice simulator: the end event was made without timing "
                            "(torch.Event(enable_timing=True))");
      TORCH_CHECK(b.reached >= b.scheduled && b.reached > 0,
                  "anydevice simulator: the end event has not been reached yet; "
                  "synchronize it before elapsed_time");
      tb = b.when;
    }
    return std::chrono::duration<double, std::milli>(tb - ta).count();
  }

  void destroyEvent(void* event, const c10::DeviceIndex /*device*/) const noexcept override {
    delete static_cast<EventHandle*>(event);
  }

  bool queryStream(const c10::Stream& stream) const override {
    return stream_of(stream.device_index(), stream.id()).query();
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    stream_of(stream.device_index(), stream.id()).synchronize();
  }
  void synchronizeDevice(const c10::DeviceIndex device) const override {
    synchronize_device(device < 0 ? t_device : device);
  }
  void recordDataPtrOnStream(const c10::DataPtr& /*unused*/,
                             const c10::Stream& /*unused*/) const override {}

 private:
  static c10::Stream from_pool(c10::Device d) {
    static std::array<std::atomic<int>, kMaxDevices> next{};
    const auto index = d.has_index() ? d.index() : t_device;
    check_index(index);
    const int id = 1 + next[index].fetch_add(1) % (kStreams - 1);
    return make_stream(index, id);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ---------------------------------------------------------------------------
// Hooks: pinned memory, the device of a pointer, generators.

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return g_device_count.load() > 0;
  }
  bool hasPrimaryContext(c10::DeviceIndex /*unused*/) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(g_device_count.load());
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    check_index(device);
    t_device = device;
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return t_device;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = t_device;
    setCurrentDevice(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return &g_pinned;
  }
  bool isPinnedPtr(const void* data) const override {
    return g_pinned.contains(data);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    const auto device = g_memory.device_of(data);
    TORCH_CHECK(device >= 0, "anydevice simulator: not a device pointer");
    return at::Device(kDev, device);
  }
  // Kernels run on the host with torch's CPU kernels, which draw from the CPU's
  // generator: the device's generator is the CPU's (seeded by torch.manual_seed).
  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*unused*/) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex /*unused*/) const override {
    return at::detail::createCPUGenerator();
  }
};

// ---------------------------------------------------------------------------
// The host's view of device memory, for kernels and for the workers' copies.

// A CPU tensor over the same bytes as a device tensor. The storage does not own them
// (the device tensor does, and outlives the alias); it may grow, in which case torch
// gives it fresh host bytes and the caller copies them back (see run_on_host).
at::Tensor host_alias(const at::Tensor& t) {
  const c10::Storage& storage = t.storage();
  c10::Storage host(c10::Storage::use_byte_size_t(), storage.nbytes(),
                    c10::DataPtr(storage.mutable_data(), c10::Device(c10::DeviceType::CPU)),
                    c10::GetCPUAllocator(), /*resizable=*/true);
  auto alias = at::detail::make_tensor<c10::TensorImpl>(
      std::move(host), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(),
                                                      t.storage_offset());
  return alias;
}

// A device tensor over a device storage, with the given shape.
at::Tensor device_view(const at::Tensor& base, const at::Tensor& shape) {
  auto view = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(base.storage()), base.key_set(), shape.dtype());
  view.unsafeGetTensorImpl()->set_sizes_and_strides(shape.sizes(), shape.strides(),
                                                     shape.storage_offset());
  return view;
}

// ---------------------------------------------------------------------------
// Kernels registered for the device.

void poison_bool(const at::Tensor& t) {
  // 0xFF is no valid bool: bool tensors start true instead (still not what was written).
  if (t.scalar_type() == at::kBool && t.storage().nbytes() > 0) {
    std::memset(t.storage().mutable_data(), 0x01, t.storage().nbytes());
  }
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device, std::optional<bool> pin,
                               std::optional<c10::MemoryFormat> memory_format) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "anydevice simulator: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin), "pinned memory is host memory");
  const c10::DeviceGuard guard(dev);
  at::Tensor t = at::detail::empty_generic(size, &g_memory, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                     c10::dtype_or_default(dtype), memory_format);
  poison_bool(t);
  return t;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "anydevice simulator: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin), "pinned memory is host memory");
  const c10::DeviceGuard guard(dev);
  at::Tensor t = at::detail::empty_strided_generic(
      size, stride, &g_memory, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
  poison_bool(t);
  return t;
}

// Grows the storage when needed. The host first waits for the current stream: work
// queued there may still write the old bytes, which are carried over.
const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size_sym,
                          std::optional<c10::MemoryFormat> memory_format) {
  const auto size = C10_AS_INTARRAYREF_SLOW(size_sym);
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  const int64_t numel = impl->numel();
  if (numel > 0) {
    const size_t needed = (impl->storage_offset() + numel) * self.dtype().itemsize();
    const c10::Storage& storage = impl->unsafe_storage();
    if (needed > storage.nbytes()) {
      const auto device = self.device().index();
      current_stream(device).synchronize();
      const c10::DeviceGuard guard(self.device());
      auto fresh = g_memory.allocate(needed);
      if (storage.nbytes() > 0) {
        std::memcpy(fresh.get(), storage.data(), storage.nbytes());
      }
      storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
      storage.unsafeGetStorageImpl()->set_nbytes(needed);
    }
  }
  if (memory_format.has_value()) {
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

// Copies. The rules are CUDA's:
// - host -> device and device -> host go on the current stream of the device's side and
//   take the link's time. With non_blocking=True and a pinned host buffer the host does
//   not wait; otherwise (a pageable buffer, or a blocking copy) it waits for the copy.
// - device -> device goes on the destination's current stream and never makes the host
//   wait, whatever non_blocking says.
at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  const bool from_device = src.device().type() == kDev;
  const bool to_device = dst.device().type() == kDev;
  if (from_device && to_device) {
    const auto device = dst.device().index();
    if (src.device().index() != device) {
      current_stream(src.device().index()).synchronize();  // across devices: src done first
    }
    current_stream(device).enqueue([src, dst] {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      host_alias(dst).copy_(host_alias(src));
    });
    return dst;
  }
  TORCH_CHECK(from_device || to_device, "anydevice simulator: a copy with no device side");
  const at::Tensor& host = from_device ? dst : src;
  TORCH_CHECK(host.is_cpu(), "anydevice simulator: copies go to and from the CPU, not ",
              host.device());
  const auto device = from_device ? src.device().index() : dst.device().index();
  const size_t bytes = static_cast<size_t>(src.numel()) * src.element_size();
  const c10::StreamId stream_id = t_stream[device];
  Stream& stream = stream_of(device, stream_id);
  // The task holds both tensors, so their memory outlives the copy even when the caller
  // drops them at once (as torch's pinned host allocator does by recording an event).
  const int64_t ticket = stream.enqueue([src, dst, device, to_device, bytes, stream_id] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    cross_link(device, to_device, bytes, stream_id);
    // The bytes land at the end of the transfer: a reader that did not wait sees the
    // poison, or the values from before.
    if (to_device) {
      host_alias(dst).copy_(src);
    } else {
      dst.copy_(host_alias(src));
    }
  });
  if (!(non_blocking && is_pinned(host))) {
    stream.wait(ticket);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst) {
  if (dst.device().type() == kDev) {
    resize_(dst, src.sym_sizes(), std::nullopt);
  } else {
    dst.resize_(src.sizes());
  }
  return copy_from(src, dst, false);
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size,
                      c10::SymIntArrayRef stride, std::optional<c10::SymInt> offset) {
  return at::native::as_strided_tensorimpl(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
      offset.has_value() ? std::make_optional(offset->expect_int()) : std::nullopt);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, source);
}

at::Tensor& set_storage_offset(at::Tensor& self, at::Storage source, c10::SymInt offset,
                               c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset.expect_int(),
                                      C10_AS_INTARRAYREF_SLOW(size),
                                      C10_AS_INTARRAYREF_SLOW(stride));
}

// ---------------------------------------------------------------------------
// Every other kernel: torch's CPU kernel, run by the host on the device memory.

struct Swapped {
  at::Tensor device;  // the caller's device tensor
  at::Tensor host;  // its host alias, given to the CPU kernel
};

// Runs `op`'s CPU kernel; the stack holds `op`'s arguments.
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t first = stack->size() - nargs;
  std::vector<Swapped> swapped;
  std::vector<bool> devices(kMaxDevices, false);
  c10::DeviceIndex home = -1;

  auto swap = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.device().type() != kDev) {
      return t;
    }
    const auto index = t.device().index();
    devices[index] = true;
    if (home < 0) {
      home = index;
    }
    auto alias = host_alias(t);
    swapped.push_back({t, alias});
    return alias;
  };

  // Tensors on two devices: refused with torch's words, as a GPU kernel refuses them. A
  // 0-dim CPU tensor passes (torch takes it as a scalar), and so do CPU tensors inside
  // optional-tensor lists (index's indices may stay on the host).
  std::optional<c10::Device> on_device, on_host;
  std::string host_arg;
  auto note = [&](const at::Tensor& t, const std::string& arg_name) {
    if (!t.defined()) {
      return;
    }
    if (t.device().type() == kDev) {
      on_device = on_device.has_value() ? on_device : t.device();
    } else if (t.dim() > 0 && !on_host.has_value()) {
      on_host = t.device();
      host_arg = arg_name;
    }
  };
  for (size_t i = first; i < stack->size(); ++i) {
    const c10::IValue& arg = (*stack)[i];
    const std::string& arg_name = schema.arguments()[i - first].name();
    if (arg.isTensor()) {
      note(arg.toTensor(), arg_name);
    } else if (arg.isTensorList()) {
      for (const at::Tensor& t : arg.toTensorList().vec()) {
        note(t, arg_name);
      }
    }
  }
  TORCH_CHECK(!on_device.has_value() || !on_host.has_value(),
              "Expected all tensors to be on the same device, but found at least two devices, ",
              on_device.value_or(c10::Device(kDev, 0)), " and ",
              on_host.value_or(c10::Device(c10::kCPU)), "! (argument '", host_arg, "' of ",
              schema.operator_name(), " is on the host; anydevice's simulated accelerator)");

  for (size_t i = first; i < stack->size(); ++i) {
    c10::IValue& arg = (*stack)[i];
    if (arg.isTensor()) {
      arg = swap(arg.toTensor());
    } else if (arg.isTensorList()) {
      auto list = arg.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        list.set(j, swap(list.get(j)));
      }
    } else if (arg.isList()) {
      auto list = arg.toList();
      for (size_t j = 0; j < list.size(); ++j) {
        c10::IValue item = list.get(j);
        if (item.isTensor()) {
          list.set(j, swap(item.toTensor()));
        }
      }
    } else if (arg.isDevice() && arg.toDevice().type() == kDev) {
      // A factory kernel asked for the device: the CPU kernel makes it on the host and
      // the result is moved below.
      const auto index = arg.toDevice().has_index() ? arg.toDevice().index() : t_device;
      devices[index] = true;
      if (home < 0) {
        home = index;
      }
      arg = c10::IValue(c10::Device(c10::DeviceType::CPU));
    }
  }
  if (home < 0) {
    home = t_device;
  }

  // The ordering rule: a kernel runs after everything queued on the current stream of
  // each device it touches, and after nothing else (work on other streams is not
  // waited for, as on a GPU).
  for (int d = 0; d < kMaxDevices; ++d) {
    if (devices[d]) {
      current_stream(static_cast<c10::DeviceIndex>(d)).synchronize();
    }
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  // A kernel that resized an output gave its host alias fresh host bytes: carry the
  // new shape and bytes over to the device tensor.
  for (const auto& s : swapped) {
    const auto& h = s.host;
    if (h.storage().data() != s.device.storage().data() || h.sizes() != s.device.sizes() ||
        h.strides() != s.device.strides() ||
        h.storage_offset() != s.device.storage_offset()) {
      if (h.storage().data() == s.device.storage().data()) {  // same bytes, new shape
        s.device.unsafeGetTensorImpl()->set_sizes_and_strides(h.sizes(), h.strides(),
                                                              h.storage_offset());
      } else {
        resize_(s.device, h.sym_sizes(), std::nullopt);
        host_alias(s.device).copy_(h);
      }
    }
  }

  // Results: an alias of an argument becomes the argument (or a view of its storage);
  // a fresh host tensor is moved into fresh device memory (a kernel's output, not a copy
  // over the link: no link time).
  auto back = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || !t.is_cpu()) {
      return t;
    }
    for (const auto& s : swapped) {
      if (t.is_same(s.host)) {
        return s.device;
      }
    }
    const void* data = t.storage().data();
    for (const auto& s : swapped) {
      if (data != nullptr && data == s.host.storage().data()) {
        return device_view(s.device, t);
      }
    }
    const c10::DeviceGuard guard(c10::Device(kDev, home));
    at::Tensor out = at::detail::empty_generic(t.sizes(), &g_memory,
                                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                         t.scalar_type(), std::nullopt);
    host_alias(out).copy_(t);
    return out;
  };
  const size_t nret = schema.returns().size();
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
    c10::IValue& ret = (*stack)[i];
    if (ret.isTensor()) {
      ret = back(ret.toTensor());
    } else if (ret.isTensorList()) {
      auto list = ret.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        list.set(j, back(list.get(j)));
      }
    }
  }
}

// Convolutions: torch sends a backend other than the CPU and CUDA to the "overrideable"
// ops, which have no CPU kernel. Their arguments are those of the generic ops (the
// backward lacks bias_sizes, which may be None), so the host runs the generic ones.
void convolution_on_host(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  static const auto target =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  run_on_host(target, stack);
}

void convolution_backward_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const auto target =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution_backward", "");
  const size_t first = stack->size() - op.schema().arguments().size();
  // (grad_output, input, weight, [bias_sizes], stride, padding, ...)
  stack->insert(stack->begin() + static_cast<std::ptrdiff_t>(first + 3), c10::IValue());
  run_on_host(target, stack);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolution_on_host>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolution_backward_on_host>());
  // These two have a composite kernel for other backends that hands their out= kernel
  // a 0-dim output, which torch's CPU kernel resizes with a deprecation warning: the
  // host runs the CPU's own kernel for the whole op instead.
  m.impl("mse_loss", torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
  m.impl("smooth_l1_loss", torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
}

// torch.autocast on this device runs, and casts nothing: ops keep their dtypes (the
// simulator models no reduced-precision units).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
}

// ---------------------------------------------------------------------------
// Controls, for anydevice.testing.

void register_hooks() {
  static bool done = false;
  if (!done) {
    at::RegisterPrivateUse1HooksInterface(new Hooks());
    done = true;
  }
}

void set_device_count(int n) {
  TORCH_CHECK(n >= 1 && n <= kMaxDevices, "devices must be between 1 and ", kMaxDevices,
              ", not ", n);
  TORCH_CHECK(!g_started.load() || n == g_device_count.load(),
              "anydevice simulator: the device count is fixed once the device is used (",
              g_device_count.load(), "); enable it with devices=", n,
              " in a fresh process");
  g_device_count = n;
}

// Simulated device work: `seconds` on the current stream's worker, returning at once,
// as a kernel launch does on a GPU.
void busy(double seconds, int device) {
  const auto index = static_cast<c10::DeviceIndex>(device < 0 ? t_device : device);
  const c10::StreamId id = t_stream[index];
  stream_of(index, id).enqueue([seconds, index, id] {
    const auto start = Clock::now();
    std::this_thread::sleep_until(
        start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
    trace("busy", index, id, 0, start, Clock::now());
  });
}

}  // namespace anydevice_sim

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace anydevice_sim;
  m.def("register_hooks", &register_hooks);
  m.def("set_device_count", &set_device_count);
  m.def("device_count", [] { return g_device_count.load(); });
  m.def("set_bandwidth", [](double b) { g_bandwidth = b; });
  m.def("bandwidth", [] { return g_bandwidth.load(); });
  m.def("set_capacity", [](int64_t c) { g_capacity = c; });
  m.def("capacity", [] { return g_capacity.load(); });
  m.def("busy", &busy, py::arg("seconds"), py::arg("device") = -1);
  m.def("set_tracing", [](bool on) { g_tracing = on; });
  m.def("take_trace", [] {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    py::list out;
    for (const auto& s : g_trace) {
      out.append(py::make_tuple(s.what, s.device, s.stream, s.bytes, s.start, s.end));
    }
    g_trace.clear();
    return out;
  });
}
