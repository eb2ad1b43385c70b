// The stream race detector: which accesses to memory are ordered, on any device.
//
// The algorithm is torch's CUDA sanitizer's (CSAN): a vector clock per stream, and per
// block of memory the last write and the reads since, each with its stream and its place
// in that stream. An access on stream S is ordered after an earlier one on stream T when
// S's clock has seen T at least as far; stream waits, event records and waits and host
// synchronisations move the clocks. What it adds:
//
// - the host is one more stream (index 0): a copy into or out of pinned memory that the
//   host has not waited for is an access the host can race with, and a stream launched
//   after a host synchronisation has seen what the host had;
// - memory freed while another stream still used it, and handed to a new tensor by the
//   allocator: the new tensor starts with the old accesses that nothing ordered (the
//   simulator's allocator says when it frees and reuses; elsewhere a new storage at the
//   address of an old one says it);
// - the timing of events: `elapsed_time` on an event the host has not seen complete;
// - the user's file:line for each access (module.cpp walks the Python frames), and what
//   to write to fix it.
//
// It learns of accesses from a dispatcher hook on every operator (watch.cpp) and of the
// synchronisations from the device's guard (torch.Stream, torch.Event, torch.accelerator
// all go through it), wrapped here: the same code for the simulator and for a real
// accelerator of any kind.

#pragma once

#include <ATen/core/TensorBase.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace anydevice_races {

// ---------------------------------------------------------------------------
// What the Python side provides (module.cpp).

// The user's frame that made the current call (file:line, and its caller in the user's
// own code when that frame is a library's), interned; -1 where no Python frame is (an
// autograd thread: the last site seen on a Python thread then stands for it).
int capture_site();
// Whether the innermost Python frame's line calls `name(` (torch's elapsed_time queries
// its events first: those queries are part of it, not the user's polling).
bool python_line_calls(const char* name);

// Lets go of Python's GIL for a block when the calling thread holds it (a wait for the
// device must not hold it: a worker may need it to drop a tensor Python also knew).
class WithoutGil {
 public:
  WithoutGil();
  ~WithoutGil();
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  void* saved_;
};

// A race found, described for the Python side.
struct StreamRef {
  bool host = false;
  std::string device;  // "sim:0"
  int64_t id = 0;  // the stream's id on its device (0: the default stream)
  int made_site = -1;  // where it was made (torch.Stream(...)), if seen
};

struct Race {
  std::string kind;  // "read after write", "write after read", "write after write", "timing"
  StreamRef now_stream, before_stream;
  int now_site = -1, before_site = -1;
  std::string now_op, before_op;  // "aten::mul", "record", ...
  std::string tensor;  // "(4, 256) float32 on sim:0"
  std::string now_trace;  // the Python traceback of a raw host access (a fault), if it was one
  bool pinned = false;  // the memory is pinned host memory
  int freed_site = -1;  // where the memory was freed before its reuse (-1: not a reuse)
  bool reused = false;  // the memory was freed and handed to a new tensor
  // A hint at the cause, when one is seen: "event on another stream" (the stream waited
  // on an event recorded on a third stream), "synchronized another stream" (the host
  // waited for another).
  std::string hint;
  int hint_site = -1, hint_site2 = -1;
  StreamRef hint_stream;
};

// Hands races to the Python side, which reports them (a warning or an exception, per the
// mode); throws the Python exception when the mode says so. Called with no lock held.
void deliver(std::vector<Race>& races);

// ---------------------------------------------------------------------------
// The detector (races.cpp).

enum class Mode : int { off = 0, warn = 1, raise = 2 };

// One access of an operator to a block of memory.
struct Use {
  const void* key;  // the storage's data pointer: the block
  const void* owner;  // the StorageImpl: a new one at an old address is a reuse
  const at::TensorBase* tensor;  // for the report
  bool write;
  bool host;  // host memory (pinned)
};

class Detector {
 public:
  // Watch the accelerator of `type`, with `simulated`: its allocator reports frees.
  void start(c10::DeviceType type, bool simulated, Mode mode);
  void set_mode(Mode mode);
  Mode mode() const { return static_cast<Mode>(mode_.load(std::memory_order_relaxed)); }
  bool active() const { return mode() != Mode::off; }
  c10::DeviceType type() const { return type_; }
  // Whether the simulator's allocator tells it of frees (else reuse is seen by address).
  bool simulated() const { return simulated_; }
  // Pinned host blocks with accesses the host has not seen complete (0: host operators
  // need not be looked at).
  int pending_host() const { return pending_host_.load(std::memory_order_relaxed); }
  void reset();  // forget every clock and access (a test's fresh start)
  void forget_reported();  // report each race again (a new test)

  // An operator on stream `s` with these uses; races found are appended to `out`.
  void kernel(const c10::Stream& s, const Use* uses, size_t n, int site, const char* op,
              std::vector<Race>& out);
  // An operator run by the host on host memory.
  void host(const Use* uses, size_t n, int site, const char* op, std::vector<Race>& out);
  // Synchronisations the host made: it has seen all of `s`'s work queued so far.
  void host_waited(const c10::Stream& s, int site);
  void host_waited_event(void* event, int site);
  void host_waited_device(c10::DeviceIndex index, int site);
  // Streams and events.
  void stream_made(const c10::Stream& s, int site);
  // Later work on `waiter` comes after all of `on`'s work so far (a copy between two
  // devices orders the source's stream after it, as CUDA's does).
  void stream_waited(const c10::Stream& waiter, const c10::Stream& on);
  void record(void* event, const c10::Stream& s, int site);
  void block(void* event, const c10::Stream& s, int site);
  void forget_event(void* event);
  void elapsed(void* start, void* end, int site, std::vector<Race>& out);
  // One event of an elapsed_time, checked when torch queries it first: whether the host
  // has not seen it complete (a race, appended to `out` the first time at this site).
  bool elapsed_one(void* event, int site, std::vector<Race>& out);
  // A raw access of the host to a pinned block (a fault of its protected mapping).
  void host_fault(const void* base, bool write, const std::string& traceback,
                  std::vector<Race>& out);
  // Pinned blocks with pending copies get protected while pending (the simulator's).
  void guard_host_memory(void (*protect)(const void*, bool), void (*unprotect)(const void*));
  // Memory: record_stream, and the simulator's allocator.
  void record_stream(const void* key, const c10::Stream& s);
  void allocated(const void* ptr, size_t size, const c10::Stream& s);
  // Returns true when the block's accesses outlive it (then `freed_at` names the free).
  bool freed(const void* ptr, size_t size, const c10::Stream& s);
  void freed_at(const void* ptr, int site);

  struct Impl;

 private:
  std::atomic<int> mode_{0};
  std::atomic<int> pending_host_{0};
  c10::DeviceType type_ = c10::DeviceType::CPU;
  bool simulated_ = false;
  Impl* impl_ = nullptr;
};

Detector& detector();

// Wrap the device guard of `type` so the detector hears of streams, events and host
// synchronisations (once; the wrapper forwards everything).
void watch_guard(c10::DeviceType type);
// Turn the operator hook on for the calling thread (watch.cpp); threads started later
// turn it on themselves (anydevice.testing.races sets that up).
void watch_thread(bool on);
void register_watch();
// Whether host memory at `data` is pinned by the accelerator in use (torch's Context, whose
// header is kept out of watch.cpp's translation unit: see sim_operators.cpp).
bool host_pinned(const void* data);

}  // namespace anydevice_races
