// The simulated accelerator's device: streams run by worker threads, the link, events,
// the device guard and hooks torch asks of a backend, and pinned host memory.
//
// - Every stream is a queue run in order by a worker thread of its own. Work queued on a
//   stream returns to the host at once; the host sees its effect only after it waits
//   (stream or event synchronisation, or a blocking copy).
// - Copies between host and device cross a link with a speed: the worker sleeps
//   bytes / bandwidth, then moves the bytes. Data lands at the END of that time, so
//   whoever reads early reads the poison (or the old values).
// - A task that fails (a kernel's error) is reported at the host's next wait for its
//   stream, as a GPU reports a failed kernel at a later call.
//
// Pinned host memory is pinned.cpp's.

#include "sim.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <unistd.h>

#include <map>
#include <thread>

namespace anydevice_sim {

std::atomic<int> g_device_count{1};
std::atomic<bool> g_started{false};
std::atomic<double> g_bandwidth{2e9};
std::atomic<int64_t> g_capacity{-1};

thread_local c10::DeviceIndex t_device = 0;
thread_local std::array<c10::StreamId, kMaxDevices> t_stream{};

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(
      index >= 0 && index < g_device_count.load(),
      "anydevice simulator: device index ", static_cast<int>(index),
      " is out of range (", g_device_count.load(), " device(s))");
}

int64_t host_memory() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}

// ---------------------------------------------------------------------------
// Streams.

int64_t Stream::enqueue(std::function<void()> task, const char* what) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!worker_started_) {
    // Detached: the process may end with tasks queued or a worker asleep; streams are
    // never destroyed, so the worker never outlives what it uses.
    std::thread([this] { run(); }).detach();
    worker_started_ = true;
  }
  queue_.push_back(Task{std::move(task), what});
  ++submitted_;
  work_.notify_one();
  return submitted_;
}

void Stream::wait(int64_t ticket) {
  reached(ticket);
  raise_failure();
}

void Stream::reached(int64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return completed_ >= ticket; });
}

void Stream::synchronize() {
  wait(submitted());
}

void Stream::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  const int64_t ticket = submitted_;
  done_.wait(lock, [&] { return completed_ >= ticket; });
}

bool Stream::query() {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ >= submitted_;
}

int64_t Stream::submitted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return submitted_;
}

bool Stream::completed_at_least(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ >= ticket;
}

void Stream::raise_failure() {
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure.swap(failure_);
  }
  TORCH_CHECK(failure.empty(), failure);
}

void Stream::run() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_.wait(lock, [&] { return !queue_.empty(); });
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string failed;
    try {
      task.run();
    } catch (const c10::Error& e) {
      failed = e.what_without_backtrace();
    } catch (const std::exception& e) {
      failed = e.what();
    }
    // Drop what the task holds (the tensors of a copy) before it counts as done, so
    // memory counters read after a synchronisation do not still include them.
    task.run = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failed.empty() && failure_.empty()) {
        failure_ = std::string("anydevice simulator: ") + task.what + ", queued on stream " +
                   std::to_string(id_) + " of device " + std::to_string(device_) +
                   ", failed when the device ran it: " + failed +
                   "\n(A GPU reports a failed kernel at a later call, as here; CUDA says "
                   "'device-side assert triggered'.)";
      }
      ++completed_;
    }
    done_.notify_all();
  }
}

Stream& stream_of(c10::DeviceIndex device, c10::StreamId id) {
  check_index(device);
  TORCH_CHECK(id >= 0 && id < kStreams, "anydevice simulator: unknown stream id ", id);
  // Never destroyed (see Stream::enqueue): made on first use, then kept.
  static std::array<std::array<std::atomic<Stream*>, kStreams>, kMaxDevices> streams{};
  static std::mutex made;
  std::atomic<Stream*>& slot = streams[static_cast<size_t>(device)][static_cast<size_t>(id)];
  Stream* s = slot.load();
  if (s == nullptr) {
    std::lock_guard<std::mutex> lock(made);
    s = slot.load();
    if (s == nullptr) {
      s = new Stream(device, id);
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
  return stream_of(device, t_stream[static_cast<size_t>(device)]);
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

namespace {
std::atomic<bool> g_tracing{false};
std::mutex g_trace_mutex;
std::vector<Span> g_trace;

double seconds_of(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}
}  // namespace

void trace(const char* what, int device, int64_t stream, int64_t bytes,
           Clock::time_point start, Clock::time_point end) {
  if (g_tracing.load()) {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    g_trace.push_back({what, device, stream, bytes, seconds_of(start), seconds_of(end)});
  }
}

void set_tracing(bool on) {
  g_tracing = on;
}

std::vector<Span> take_trace() {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  std::vector<Span> out;
  out.swap(g_trace);
  return out;
}

// ---------------------------------------------------------------------------
// The link: one per device and direction, like a GPU's copy engines. Transfers in the
// same direction share it (one after the other); each takes bytes / bandwidth.

namespace {
struct Link {
  std::mutex mutex;
  Clock::time_point free_at{};
};

Link& link_of(c10::DeviceIndex device, bool to_device) {
  static std::array<std::array<Link, 2>, kMaxDevices> links;
  return links[static_cast<size_t>(device)][to_device ? 1 : 0];
}
}  // namespace

void cross_link(c10::DeviceIndex device, bool to_device, size_t bytes, int64_t stream) {
  const double bandwidth = g_bandwidth.load();
  const char* what = to_device ? "h2d" : "d2h";
  if (bandwidth <= 0 || bytes == 0) {
    const auto now = Clock::now();
    trace(what, device, stream, static_cast<int64_t>(bytes), now, now);
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
  trace(what, device, stream, static_cast<int64_t>(bytes), start, end);
}

// ---------------------------------------------------------------------------
// Events: recorded by a stream's worker when it reaches them, with the worker's clock.

namespace {

struct Event {
  std::mutex mutex;
  std::condition_variable cv;
  int64_t scheduled = 0;  // versions queued by record()
  int64_t reached = 0;  // the newest version a worker reached
  Clock::time_point when{};
  bool timing = false;
  c10::DeviceIndex device = 0;  // where it was last recorded
  c10::StreamId stream = 0;
  int64_t ticket = 0;  // the newest record's place in its stream's queue
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
// The device guard: current device, streams, events, for torch's device-generic API.

class Guard final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kDev, t_device); }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    t_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_device = d.index(); }
  c10::Stream getStream(c10::Device d) const noexcept override {
    const auto index = d.has_index() ? d.index() : t_device;
    return make_stream(index, t_stream[static_cast<size_t>(index)]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return make_stream(d.has_index() ? d.index() : t_device, 0);
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override { return from_pool(d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high*/) const override {
    return from_pool(d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    const auto index = static_cast<size_t>(s.device_index());
    auto old = make_stream(s.device_index(), t_stream[index]);
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
      ev->device = stream.device_index();
      ev->stream = stream.id();
    }
    const int64_t ticket = stream_of(stream.device_index(), stream.id()).enqueue(
        [ev, version] {
          {
            std::lock_guard<std::mutex> lock(ev->mutex);
            ev->when = Clock::now();
            ev->reached = std::max(ev->reached, version);
          }
          ev->cv.notify_all();
        },
        "an event's record");
    std::lock_guard<std::mutex> lock(ev->mutex);
    if (ev->scheduled == version) {
      ev->ticket = ticket;
    }
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
    stream_of(stream.device_index(), stream.id()).enqueue(
        [ev, version] {
          std::unique_lock<std::mutex> lock(ev->mutex);
          ev->cv.wait(lock, [&] { return ev->reached >= version; });
        },
        "a wait for an event");
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
    c10::DeviceIndex device;
    c10::StreamId stream;
    int64_t ticket;
    {
      std::unique_lock<std::mutex> lock(ev.mutex);
      const int64_t version = ev.scheduled;
      ev.cv.wait(lock, [&] { return ev.reached >= version; });
      device = ev.device;
      stream = ev.stream;
      ticket = ev.ticket;
    }
    // And the record counted done on its stream: a stream whose last work was the event
    // then answers query() with True, as CUDA's does.
    stream_of(device, stream).wait(ticket);
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
  void recordDataPtrOnStream(const c10::DataPtr& ptr, const c10::Stream& stream) const override {
    device_allocator()->recordStream(ptr, stream);
  }

 private:
  static c10::Stream from_pool(c10::Device d) {
    static std::array<std::atomic<int>, kMaxDevices> next{};
    const auto index = d.has_index() ? d.index() : t_device;
    check_index(index);
    const int id = 1 + next[static_cast<size_t>(index)].fetch_add(1) % (kStreams - 1);
    return make_stream(index, id);
  }
};

// ---------------------------------------------------------------------------
// Hooks: pinned memory, the device of a pointer, generators.

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_device_count.load() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex /*unused*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(g_device_count.load());
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    check_index(device);
    t_device = device;
  }
  c10::DeviceIndex getCurrentDevice() const override { return t_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = t_device;
    setCurrentDevice(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  at::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  at::Device getDeviceFromPtr(void* data) const override {
    const auto device = device_of_ptr(data);
    TORCH_CHECK(device >= 0, "anydevice simulator: not a device pointer");
    return at::Device(kDev, device);
  }
  // Kernels run with torch's CPU kernels, which draw from the CPU's generator: the
  // device's generator is the CPU's (seeded by torch.manual_seed).
  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*unused*/) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex /*unused*/) const override {
    return at::detail::createCPUGenerator();
  }
};

}  // namespace

void register_device() {
  static bool done = false;
  if (done) {
    return;
  }
  static c10::impl::DeviceGuardImplRegistrar guard(kDev, new Guard());
  c10::SetAllocator(kDev, device_allocator());
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  done = true;
}

// ---------------------------------------------------------------------------
// Controls.

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
  const c10::StreamId id = t_stream[static_cast<size_t>(index)];
  stream_of(index, id).enqueue(
      [seconds, index, id] {
        const auto start = Clock::now();
        std::this_thread::sleep_until(
            start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
        trace("busy", index, id, 0, start, Clock::now());
      },
      "busy");
}

}  // namespace anydevice_sim
