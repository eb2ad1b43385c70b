// The simulated accelerator's parts, shared by its translation units:
//
//   device.cpp   settings, streams and their workers, the link, events, the device guard,
//                the hooks (pinned memory, generators), pinned host memory
//   memory.cpp   the caching device allocator (CUDA's stream rules)
//   kernels.cpp  the aten kernels: asynchronous kernels on the workers, copies, views
//   recurrent_cells.cpp  the fused LSTM and GRU cells (CUDA has kernels for them, the CPU not)
//   races.h/.cpp the stream race detector (any device; see races.h)
//   module.cpp   the Python module: controls, and the detector's Python side
//   boxed.h      reading a boxed call's arguments (the kernels are registered boxed)
//
// Split so that the heavy headers (the dispatcher's) are parsed by one file, and the
// files build in parallel.

#pragma once

#include <ATen/core/TensorBase.h>
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Stream.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
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
// Settings (device.cpp).

extern std::atomic<int> g_device_count;
extern std::atomic<bool> g_started;  // the device count is fixed once anything ran
extern std::atomic<double> g_bandwidth;  // bytes per second, each direction; 0: no delay
extern std::atomic<int64_t> g_capacity;  // bytes per device; -1: the host's memory

extern thread_local c10::DeviceIndex t_device;
extern thread_local std::array<c10::StreamId, kMaxDevices> t_stream;  // 0: the default

void check_index(c10::DeviceIndex index);
int64_t host_memory();

// ---------------------------------------------------------------------------
// Streams: a queue and the worker thread that runs it (device.cpp).

class Stream {
 public:
  Stream(c10::DeviceIndex device, c10::StreamId id) : device_(device), id_(id) {}

  // Queue a task; returns its ticket (its place in the queue, from 1). `what` names the
  // work for the message when it fails (an operator's name).
  int64_t enqueue(std::function<void()> task, const char* what = "a queued task");
  // The host waits for every task queued up to `ticket`; raises a failure of one of them.
  void wait(int64_t ticket);
  // Another stream's worker waits for the task `ticket` (its failure stays this stream's).
  void reached(int64_t ticket);
  // The host waits for everything queued so far.
  void synchronize();
  bool query();
  int64_t submitted();
  bool completed_at_least(int64_t ticket);
  // Waits for everything queued so far, leaving failures to be raised later.
  void drain();
  // Raise (once) the failure of a task that ran since the last look, as a GPU reports a
  // failed kernel at a later call.
  void raise_failure();

  c10::DeviceIndex device() const { return device_; }
  c10::StreamId id() const { return id_; }

 private:
  struct Task {
    std::function<void()> run;
    const char* what;
  };
  void run();

  const c10::DeviceIndex device_;
  const c10::StreamId id_;
  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::deque<Task> queue_;
  int64_t submitted_ = 0, completed_ = 0;
  bool worker_started_ = false;
  std::string failure_;  // the first task failure not yet raised
};

Stream& stream_of(c10::DeviceIndex device, c10::StreamId id);
Stream& current_stream(c10::DeviceIndex device);
void synchronize_device(c10::DeviceIndex device);
c10::Stream make_stream(c10::DeviceIndex device, c10::StreamId id);

// The link: sleeps for a transfer's time on it (called by a worker).
void cross_link(c10::DeviceIndex device, bool to_device, size_t bytes, int64_t stream);
// Records a piece of work for testing.trace() (when tracing is on).
void trace(const char* what, int device, int64_t stream, int64_t bytes,
           Clock::time_point start, Clock::time_point end);

// ---------------------------------------------------------------------------
// Memory (memory.cpp for the device, device.cpp for pinned host memory).

c10::DeviceAllocator* device_allocator();
// Allocates on `device` for the current stream there (the block's stream, as on CUDA),
// and queues its poison there (unless t_unpoisoned: the caller's task poisons it).
c10::DataPtr allocate(c10::DeviceIndex device, size_t bytes);
extern thread_local bool t_unpoisoned;
// The device a pointer into device memory belongs to, or -1.
c10::DeviceIndex device_of_ptr(const void* ptr);
// Pinned host memory (pinned.cpp): mapped twice, the host's mapping protected while a
// copy into or out of it is pending, so that the host's raw accesses fault.
c10::Allocator* pinned_allocator();
bool is_pinned_ptr(const void* ptr);
bool is_pinned(const at::TensorBase& t);
void* pinned_alias(const void* ptr);  // the workers' address for a host address in a block
void protect_pinned(const void* base, bool no_reads);
void unprotect_pinned(const void* base);
struct HostFault {
  const void* base;  // the block
  bool write;
  std::string traceback;  // the faulting thread's Python frames, most recent first
};
void watch_host_faults(void (*on_fault)());  // on_fault: called in the signal handler
std::vector<HostFault> take_host_faults();

// ---------------------------------------------------------------------------
// Controls (device.cpp), for the Python module.

struct Span {
  std::string what;  // "h2d", "d2h" or "busy"
  int device;
  int64_t stream;
  int64_t bytes;
  double start, end;  // seconds on the steady clock (time.monotonic's clock on Linux)
};

void set_device_count(int n);
void busy(double seconds, int device);
void set_tracing(bool on);
std::vector<Span> take_trace();

// ---------------------------------------------------------------------------
// Registration with torch (once, at anydevice.testing.enable()).

void register_device();  // device.cpp: the guard, the hooks, the allocators
void register_kernels();  // kernels.cpp: the aten kernels

}  // namespace anydevice_sim
