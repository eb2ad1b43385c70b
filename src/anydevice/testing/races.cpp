// The stream race detector's core and the device guard it listens through (races.h).

#include "races.h"

#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace anydevice_races {
// Named, not anonymous: Detector::Impl's fields have these types.
namespace detail {

constexpr int kHost = 0;  // the host's index among the streams
constexpr size_t kWaits = 4;  // waits kept per stream, for the hints

// One access: on which stream, its place there, where in the user's code, which operator.
struct Access {
  int32_t stream = -1;  // -1: none
  uint32_t seq = 0;
  int32_t site = -1;
  const char* op = "";
  uint64_t tick = 0;  // when the host launched it, among all launches, records and waits
};

// A stream's wait on an event (torch skips a wait on an event never recorded: the guard
// never hears of it).
struct Wait {
  void* event;
  int site;
  uint64_t tick;
  int recorded_on;  // the stream the event was recorded on
  int record_site;
};

struct StreamState {
  c10::Stream stream;
  bool host = false;
  std::vector<uint32_t> clock;  // clock[i]: how far this stream is ordered after stream i
  uint32_t seq = 0;  // its operators so far (== clock[itself])
  uint64_t absorbed = 0;  // the host epoch it has seen
  int made_site = -1;
  std::vector<Wait> waits;  // the last few, newest last
};

struct EventState {
  std::vector<uint32_t> clock;
  int stream = -1;
  int site = -1;
};

// What is known of one block of memory (a storage).
struct Block {
  Access write;
  std::vector<Access> reads;  // since the last write: the newest per stream
  std::vector<int> recorded;  // streams given with record_stream
  const void* owner = nullptr;
  bool host = false;  // pinned host memory
  bool reused = false;  // handed to this tensor after a free that left accesses behind
  int freed_site = -1;
};

// A block freed while another stream's accesses to it were not yet ordered.
struct Grave {
  uintptr_t end = 0;
  Access write;
  std::vector<Access> reads;
  int freed_site = -1;
};

uint64_t stream_key(const c10::Stream& s) {
  return (static_cast<uint64_t>(s.id()) << 16) ^
         (static_cast<uint64_t>(static_cast<uint8_t>(s.device_index())) << 8) ^
         static_cast<uint64_t>(static_cast<uint8_t>(s.device_type()));
}

uint32_t at(const std::vector<uint32_t>& clock, int i) {
  return static_cast<size_t>(i) < clock.size() ? clock[static_cast<size_t>(i)] : 0;
}

void join(std::vector<uint32_t>& into, const std::vector<uint32_t>& other) {
  if (into.size() < other.size()) {
    into.resize(other.size(), 0);
  }
  for (size_t i = 0; i < other.size(); ++i) {
    into[i] = std::max(into[i], other[i]);
  }
}

// torch's Python name of a dtype ("float32", not c10's "Float").
std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Short: return "int16";
    case c10::ScalarType::Char: return "int8";
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Bool: return "bool";
    case c10::ScalarType::ComplexFloat: return "complex64";
    case c10::ScalarType::ComplexDouble: return "complex128";
    default: return c10::toString(t);
  }
}

std::string describe(const at::TensorBase& t) {
  std::ostringstream out;
  out << "(";
  const auto sizes = t.sizes();
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << (i ? ", " : "") << sizes[i];
  }
  out << (sizes.size() == 1 ? ",)" : ")") << " " << dtype_name(t.scalar_type()) << " on "
      << (t.is_cpu() ? std::string("the host") : t.device().str());
  return out.str();
}

}  // namespace detail

using namespace detail;

struct Detector::Impl {
  std::mutex mu;
  std::vector<StreamState> streams;  // [kHost]: the host
  std::unordered_map<uint64_t, int> index;
  std::unordered_map<void*, EventState> events;
  std::unordered_map<const void*, Block> blocks;
  std::unordered_set<const void*> host_blocks;  // pinned blocks with accesses pending
  std::map<uintptr_t, Grave> graves;
  std::unordered_set<std::string> seen;  // races reported, so each is reported once
  uint64_t epoch = 1;  // the host's clock changed this many times
  uint64_t tick = 0;  // launches, records and waits so far
  bool simulated = false;
  int last_wait_stream = -1, last_wait_site = -1;  // the host's last stream or event wait
  uint64_t last_wait_tick = 0;
  std::atomic<int>* pending = nullptr;
  void (*protect)(const void*, bool) = nullptr;  // a pinned block's pending copies
  void (*unprotect)(const void*) = nullptr;

  // Protects a pinned block while copies into (no host access) or out of it (no host
  // write) are pending; lifted when the host has seen them complete.
  void guard(const void* key, const Block& b) {
    if (protect != nullptr) {
      protect(key, b.write.stream >= 0 && !ordered(kHost, b.write));
    }
  }

  void release(const void* key) {
    if (unprotect != nullptr) {
      unprotect(key);
    }
  }

  Impl() { clear(); }

  void clear() {
    streams.clear();
    index.clear();
    events.clear();
    blocks.clear();
    host_blocks.clear();
    graves.clear();
    seen.clear();
    epoch = 1;
    tick = 0;
    last_wait_stream = last_wait_site = -1;
    StreamState host{c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU))};
    host.host = true;
    host.clock.assign(1, 0);
    streams.push_back(std::move(host));
    if (pending != nullptr) {
      pending->store(0);
    }
  }

  int stream_index(const c10::Stream& s) {
    const uint64_t key = stream_key(s);
    auto it = index.find(key);
    if (it != index.end()) {
      return it->second;
    }
    const int i = static_cast<int>(streams.size());
    StreamState state{s};
    state.clock.assign(static_cast<size_t>(i) + 1, 0);
    streams.push_back(std::move(state));
    index.emplace(key, i);
    return i;
  }

  // Work a stream gets from now on comes after what the host has seen.
  StreamState& launch(int i) {
    StreamState& st = streams[static_cast<size_t>(i)];
    if (st.absorbed != epoch) {
      join(st.clock, streams[kHost].clock);
      st.absorbed = epoch;
    }
    if (st.clock.size() <= static_cast<size_t>(i)) {
      st.clock.resize(static_cast<size_t>(i) + 1, 0);
    }
    return st;
  }

  uint32_t step(int i) {
    StreamState& st = launch(i);
    st.seq += 1;
    st.clock[static_cast<size_t>(i)] = st.seq;
    return st.seq;
  }

  bool ordered(int now, const Access& a) const {
    return a.stream == now || at(streams[static_cast<size_t>(now)].clock, a.stream) >= a.seq;
  }

  StreamRef ref(int i) const {
    StreamRef r;
    const StreamState& st = streams[static_cast<size_t>(i)];
    r.host = st.host;
    if (!st.host) {
      r.device = c10::Device(st.stream.device_type(), st.stream.device_index()).str();
      r.id = st.stream.id();
      r.made_site = st.made_site;
    }
    return r;
  }

  void host_learned(int waited, int site) {
    epoch += 1;
    last_wait_stream = waited;
    last_wait_site = site;
    last_wait_tick = ++tick;
    prune();
  }

  // Forget pinned blocks and graves whose every access the host has seen complete.
  void prune() {
    for (auto it = host_blocks.begin(); it != host_blocks.end();) {
      auto b = blocks.find(*it);
      if (b == blocks.end() || done(b->second.write, b->second.reads)) {
        if (b != blocks.end()) {
          blocks.erase(b);
        }
        release(*it);
        it = host_blocks.erase(it);
      } else {
        ++it;
      }
    }
    pending->store(static_cast<int>(host_blocks.size()));
    for (auto it = graves.begin(); it != graves.end();) {
      it = done(it->second.write, it->second.reads) ? graves.erase(it) : std::next(it);
    }
  }

  bool done(const Access& write, const std::vector<Access>& reads) const {
    if (write.stream >= 0 && !ordered(kHost, write)) {
      return false;
    }
    return std::all_of(reads.begin(), reads.end(), [&](const Access& r) { return ordered(kHost, r); });
  }

  Block& block_for(const Use& use) {
    auto [it, fresh] = blocks.try_emplace(use.key);
    Block& b = it->second;
    if (fresh || b.owner == use.owner) {
      b.owner = use.owner;
      return b;
    }
    if (b.owner == nullptr) {  // made by allocated(): its first user
      b.owner = use.owner;
    } else if (b.host || use.host || simulated) {
      // Host memory is reused only once its copies are done (the pinned allocators wait
      // for them); the simulator's allocator says itself when it reuses a block.
      if (host_blocks.erase(use.key) > 0) {
        release(use.key);
      }
      pending->store(static_cast<int>(host_blocks.size()));
      b = Block{};
      b.owner = use.owner;
    } else {
      // A new storage at an old block's address: the allocator reused it. What the old
      // tensor's streams did stays, but for the streams given by record_stream (the
      // allocator waited for them).
      drop_recorded(b.write, b.reads, b.recorded);
      b.recorded.clear();
      b.owner = use.owner;
      b.reused = true;
      b.freed_site = -1;
    }
    return b;
  }

  static void drop_recorded(Access& write, std::vector<Access>& reads, const std::vector<int>& recorded) {
    auto in = [&](int s) { return std::find(recorded.begin(), recorded.end(), s) != recorded.end(); };
    if (write.stream >= 0 && in(write.stream)) {
      write = Access{};
    }
    reads.erase(std::remove_if(reads.begin(), reads.end(), [&](const Access& r) { return in(r.stream); }),
                reads.end());
  }

  // Checks `now` against what `b` holds, then records it (unless `now` is the host's).
  void access(Block& b, const Use& use, const Access& now, std::vector<Race>& out) {
    const int s = now.stream;
    if (!use.write) {
      if (b.write.stream >= 0 && !ordered(s, b.write)) {
        report("read after write", b, use, now, b.write, out);
      }
    } else if (!b.reads.empty()) {
      for (const Access& r : b.reads) {
        if (!ordered(s, r)) {
          report("write after read", b, use, now, r, out);
          break;
        }
      }
    } else if (b.write.stream >= 0 && !ordered(s, b.write)) {
      report("write after write", b, use, now, b.write, out);
    }
    if (s == kHost) {
      return;  // work launched later is ordered after the host anyway
    }
    if (use.write) {
      b.write = now;
      b.reads.clear();
    } else {
      auto r = std::find_if(b.reads.begin(), b.reads.end(), [&](const Access& a) { return a.stream == s; });
      if (r != b.reads.end()) {
        *r = now;
      } else {
        b.reads.push_back(now);
      }
    }
  }

  void report(const char* kind, const Block& b, const Use& use, const Access& now,
              const Access& before, std::vector<Race>& out) {
    std::ostringstream key;
    // Once per pair of lines and operators (a loop that makes a new stream each time races
    // once, not once per stream).
    key << kind << '|' << now.site << '|' << before.site << '|' << now.op << '|' << before.op;
    if (!seen.insert(key.str()).second) {
      return;
    }
    Race race;
    race.kind = kind;
    race.now_stream = ref(now.stream);
    race.before_stream = ref(before.stream);
    race.now_site = now.site;
    race.before_site = before.site;
    race.now_op = now.op;
    race.before_op = before.op;
    race.tensor = use.tensor != nullptr ? describe(*use.tensor) : "";
    race.pinned = b.host;
    race.reused = b.reused;
    race.freed_site = b.freed_site;
    hint(race, now.stream, before.stream, before.tick);
    out.push_back(std::move(race));
  }

  // Why the two streams were not ordered, where a wait or a synchronisation says so.
  void hint(Race& race, int now, int before, uint64_t before_tick) const {
    if (now == kHost) {
      if (last_wait_stream > 0 && last_wait_stream != before && last_wait_tick > before_tick) {
        race.hint = "synchronized another stream";
        race.hint_stream = ref(last_wait_stream);
        race.hint_site = last_wait_site;
      }
      return;
    }
    const auto& waits = streams[static_cast<size_t>(now)].waits;
    for (auto w = waits.rbegin(); w != waits.rend(); ++w) {
      // A wait issued after the access, on an event recorded on another stream.
      if (w->recorded_on != before && w->tick > before_tick) {
        race.hint = "event on another stream";
        race.hint_stream = ref(w->recorded_on);
        race.hint_site = w->record_site;
        race.hint_site2 = w->site;
        return;
      }
    }
  }
};

void Detector::start(c10::DeviceType type, bool simulated, Mode mode) {
  if (impl_ == nullptr) {
    impl_ = new Impl();  // never destroyed: frees may come during the process's exit
    impl_->pending = &pending_host_;
  }
  type_ = type;
  simulated_ = simulated;
  impl_->simulated = simulated;
  set_mode(mode);
}

void Detector::set_mode(Mode mode) {
  mode_.store(static_cast<int>(mode));
}

void Detector::forget_reported() {
  if (impl_ != nullptr) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->seen.clear();
  }
}

void Detector::reset() {
  if (impl_ != nullptr) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->clear();
  }
}

void Detector::kernel(const c10::Stream& s, const Use* uses, size_t n, int site, const char* op,
                      std::vector<Race>& out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int i = impl_->stream_index(s);
  const Access now{i, impl_->step(i), site, op, ++impl_->tick};
  for (size_t k = 0; k < n; ++k) {
    const Use& use = uses[k];
    Block& b = impl_->block_for(use);
    impl_->access(b, use, now, out);
    if (use.host) {
      if (!b.host) {
        b.host = true;
        impl_->host_blocks.insert(use.key);
        pending_host_.store(static_cast<int>(impl_->host_blocks.size()));
      }
      impl_->guard(use.key, b);
    }
  }
}

void Detector::host(const Use* uses, size_t n, int site, const char* op, std::vector<Race>& out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Access now{kHost, 0, site, op, ++impl_->tick};
  for (size_t k = 0; k < n; ++k) {
    auto it = impl_->blocks.find(uses[k].key);
    if (it != impl_->blocks.end() && it->second.host && it->second.owner == uses[k].owner) {
      const size_t before = out.size();
      impl_->access(it->second, uses[k], now, out);
      if (out.size() > before) {
        impl_->release(uses[k].key);  // reported: the access goes on without a fault
      }
    }
  }
}

void Detector::host_fault(const void* base, bool write, const std::string& traceback,
                          std::vector<Race>& out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->blocks.find(base);
  if (it == impl_->blocks.end() || !it->second.host) {
    return;
  }
  Block& b = it->second;
  const Use use{base, b.owner, nullptr, write, true};
  const Access now{kHost, 0, -1, write ? "a write outside torch's operators"
                                       : "a read outside torch's operators", ++impl_->tick};
  const size_t before = out.size();
  impl_->access(b, use, now, out);
  for (size_t k = before; k < out.size(); ++k) {
    out[k].now_trace = traceback;
    out[k].tensor = "of pinned host memory";
  }
}

void Detector::guard_host_memory(void (*protect)(const void*, bool), void (*unprotect)(const void*)) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->protect = protect;
  impl_->unprotect = unprotect;
}

void Detector::host_waited(const c10::Stream& s, int site) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int i = impl_->stream_index(s);
  join(impl_->streams[kHost].clock, impl_->streams[static_cast<size_t>(i)].clock);
  impl_->host_learned(i, site);
}

void Detector::host_waited_event(void* event, int site) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->events.find(event);
  if (it != impl_->events.end()) {
    join(impl_->streams[kHost].clock, it->second.clock);
    impl_->host_learned(it->second.stream, site);
  }
}

void Detector::host_waited_device(c10::DeviceIndex index, int site) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& host = impl_->streams[kHost].clock;
  for (size_t i = 1; i < impl_->streams.size(); ++i) {
    const c10::Stream& s = impl_->streams[i].stream;
    if (s.device_type() == type_ && s.device_index() == index) {
      join(host, impl_->streams[i].clock);
    }
  }
  impl_->host_learned(-1, site);
}

void Detector::stream_made(const c10::Stream& s, int site) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->streams[static_cast<size_t>(impl_->stream_index(s))].made_site = site;
}

void Detector::stream_waited(const c10::Stream& waiter, const c10::Stream& on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int w = impl_->stream_index(waiter);
  const int o = impl_->stream_index(on);
  StreamState& st = impl_->launch(w);
  join(st.clock, impl_->streams[static_cast<size_t>(o)].clock);
}

void Detector::record(void* event, const c10::Stream& s, int site) {
  if (event == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int i = impl_->stream_index(s);
  impl_->step(i);  // the event is a point of its own on the stream: reached after the work before it
  ++impl_->tick;
  EventState& ev = impl_->events[event];
  ev.clock = impl_->streams[static_cast<size_t>(i)].clock;
  ev.stream = i;
  ev.site = site;
}

void Detector::block(void* event, const c10::Stream& s, int site) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int i = impl_->stream_index(s);
  StreamState& st = impl_->launch(i);
  auto it = event == nullptr ? impl_->events.end() : impl_->events.find(event);
  if (it == impl_->events.end()) {
    return;  // an event recorded before the detector started
  }
  join(st.clock, it->second.clock);
  const Wait w{event, site, ++impl_->tick, it->second.stream, it->second.site};
  if (st.waits.size() == kWaits) {
    st.waits.erase(st.waits.begin());
  }
  st.waits.push_back(w);
}

void Detector::forget_event(void* event) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->events.erase(event);
  for (auto& st : impl_->streams) {
    for (auto& w : st.waits) {
      if (w.event == event) {
        w.event = nullptr;
      }
    }
  }
}

void Detector::elapsed(void* start, void* end, int site, std::vector<Race>& out) {
  elapsed_one(end, site, out);
  if (out.empty()) {
    elapsed_one(start, site, out);
  }
}

bool Detector::elapsed_one(void* event, int site, std::vector<Race>& out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->events.find(event);
  if (it == impl_->events.end()) {
    return false;  // never recorded: torch refuses it itself
  }
  const EventState& ev = it->second;
  Access recorded{ev.stream, at(ev.clock, ev.stream), ev.site, "record", 0};
  if (impl_->ordered(kHost, recorded)) {
    return false;
  }
  std::ostringstream key;
  key << "timing|" << site << '|' << ev.site;
  if (!impl_->seen.insert(key.str()).second) {
    return true;  // reported before
  }
  Race race;
  race.kind = "timing";
  race.now_stream = impl_->ref(kHost);
  race.before_stream = impl_->ref(ev.stream);
  race.now_site = site;
  race.before_site = ev.site;
  race.now_op = "elapsed_time";
  race.before_op = "record";
  impl_->hint(race, kHost, ev.stream, 0);
  out.push_back(std::move(race));
  return true;
}

void Detector::record_stream(const void* key, const c10::Stream& s) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int i = impl_->stream_index(s);
  Block& b = impl_->blocks[key];
  if (std::find(b.recorded.begin(), b.recorded.end(), i) == b.recorded.end()) {
    b.recorded.push_back(i);
  }
}

void Detector::allocated(const void* ptr, size_t size, const c10::Stream& s) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int i = impl_->stream_index(s);
  impl_->launch(i);
  Block b;
  const auto start = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t end = start + size;
  auto it = impl_->graves.upper_bound(start);
  if (it != impl_->graves.begin()) {
    --it;
  }
  while (it != impl_->graves.end() && it->first < end) {
    Grave& g = it->second;
    if (g.end <= start) {
      ++it;
      continue;
    }
    auto keep = [&](const Access& a) { return a.stream >= 0 && !impl_->ordered(i, a); };
    if (keep(g.write)) {
      b.write = g.write;
    }
    for (const Access& r : g.reads) {
      if (keep(r)) {
        b.reads.push_back(r);
      }
    }
    if (b.write.stream >= 0 || !b.reads.empty()) {
      b.reused = true;
      b.freed_site = g.freed_site;
    }
    it = (it->first >= start && g.end <= end) ? impl_->graves.erase(it) : std::next(it);
  }
  impl_->blocks[ptr] = std::move(b);
}

bool Detector::freed(const void* ptr, size_t size, const c10::Stream& s) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->blocks.find(ptr);
  if (it == impl_->blocks.end()) {
    return false;
  }
  Block b = std::move(it->second);
  impl_->blocks.erase(it);
  const int i = impl_->stream_index(s);
  impl_->launch(i);
  Impl::drop_recorded(b.write, b.reads, b.recorded);
  Grave g;
  g.end = reinterpret_cast<uintptr_t>(ptr) + size;
  auto keep = [&](const Access& a) { return a.stream >= 0 && !impl_->ordered(i, a); };
  if (keep(b.write)) {
    g.write = b.write;
  }
  for (const Access& r : b.reads) {
    if (keep(r)) {
      g.reads.push_back(r);
    }
  }
  if (g.write.stream < 0 && g.reads.empty()) {
    return false;
  }
  impl_->graves[reinterpret_cast<uintptr_t>(ptr)] = std::move(g);
  return true;
}

void Detector::freed_at(const void* ptr, int site) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->graves.find(reinterpret_cast<uintptr_t>(ptr));
  if (it != impl_->graves.end()) {
    it->second.freed_site = site;
  }
}

Detector& detector() {
  static Detector* d = new Detector();  // never destroyed (see start)
  return *d;
}

// ---------------------------------------------------------------------------
// The device guard, wrapped: everything is forwarded, and the detector hears of the
// streams made, the events recorded and waited on, and what the host waited for.

namespace {

class WatchingGuard final : public c10::impl::DeviceGuardImplInterface {
 public:
  explicit WatchingGuard(const DeviceGuardImplInterface* inner) : inner_(inner) {}

  c10::DeviceType type() const override { return inner_->type(); }
  c10::Device exchangeDevice(c10::Device d) const override { return inner_->exchangeDevice(d); }
  c10::Device getDevice() const override { return inner_->getDevice(); }
  void setDevice(c10::Device d) const override { inner_->setDevice(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { inner_->uncheckedSetDevice(d); }
  c10::Stream getStream(c10::Device d) const override { return inner_->getStream(d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return inner_->getDefaultStream(d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high) const override {
    return made(inner_->getStreamFromGlobalPool(d, high));
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return made(inner_->getNewStream(d, priority));
  }
  c10::Stream exchangeStream(c10::Stream s) const override { return inner_->exchangeStream(s); }
  void* getStreamNativeHandle(const c10::Stream s) const override {
    return inner_->getStreamNativeHandle(s);
  }
  void destroyEvent(void* event, const c10::DeviceIndex index) const noexcept override {
    if (event != nullptr) {
      detector().forget_event(event);
    }
    inner_->destroyEvent(event, index);
  }
  void record(void** event, const c10::Stream& s, const c10::DeviceIndex index,
              const c10::EventFlag flag) const override {
    inner_->record(event, s, index, flag);
    if (detector().active()) {
      detector().record(*event, s, capture_site());
    }
  }
  void block(void* event, const c10::Stream& s) const override {
    inner_->block(event, s);
    if (detector().active()) {
      detector().block(event, s, capture_site());
    }
  }
  bool queryEvent(void* event) const override {
    if (event != nullptr && detector().active() && python_line_calls("elapsed_time")) {
      // torch's elapsed_time queries both events first, and refuses unfinished ones: the
      // missing synchronisation is reported here, whatever the timing, and the query
      // teaches the host nothing.
      std::vector<Race> races;
      if (detector().elapsed_one(event, capture_site(), races)) {
        if (!races.empty()) {
          deliver(races);  // raises, in the "raise" mode
        }
        // Reported as a warning: wait for the event, so elapsed_time goes on whatever
        // the timing, rather than fail or not as the device happens to be done.
        WithoutGil unlocked;
        inner_->synchronizeEvent(event);
      }
      return inner_->queryEvent(event);
    }
    const bool done = inner_->queryEvent(event);
    if (done && event != nullptr && detector().active()) {
      detector().host_waited_event(event, capture_site());
    }
    return done;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return inner_->deviceCount(); }
  c10::DeviceCapability getDeviceCapability(c10::Device d) const override {
    return inner_->getDeviceCapability(d);
  }
  bool queryStream(const c10::Stream& s) const override {
    const bool done = inner_->queryStream(s);
    if (done && detector().active()) {
      detector().host_waited(s, capture_site());
    }
    return done;
  }
  void synchronizeStream(const c10::Stream& s) const override {
    {
      WithoutGil unlocked;
      inner_->synchronizeStream(s);
    }
    if (detector().active()) {
      detector().host_waited(s, capture_site());
    }
  }
  bool isStreamCapturing(const c10::Stream& s) const override { return inner_->isStreamCapturing(s); }
  void synchronizeEvent(void* event) const override {
    {
      WithoutGil unlocked;
      inner_->synchronizeEvent(event);
    }
    if (event != nullptr && detector().active()) {
      detector().host_waited_event(event, capture_site());
    }
  }
  void synchronizeDevice(const c10::DeviceIndex index) const override {
    {
      WithoutGil unlocked;
      inner_->synchronizeDevice(index);
    }
    if (detector().active()) {
      detector().host_waited_device(index < 0 ? inner_->getDevice().index() : index, capture_site());
    }
  }
  void recordDataPtrOnStream(const c10::DataPtr& ptr, const c10::Stream& s) const override {
    inner_->recordDataPtrOnStream(ptr, s);
    if (ptr.get() != nullptr && detector().active()) {
      detector().record_stream(ptr.get(), s);
    }
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex index) const override {
    if (detector().active()) {
      std::vector<Race> races;
      detector().elapsed(start, end, capture_site(), races);
      if (!races.empty()) {
        deliver(races);
      }
    }
    return inner_->elapsedTime(start, end, index);
  }

 private:
  c10::Stream made(c10::Stream s) const {
    if (detector().active()) {
      detector().stream_made(s, capture_site());
    }
    return s;
  }

  const DeviceGuardImplInterface* inner_;
};

}  // namespace

void watch_guard(c10::DeviceType type) {
  static std::mutex mu;
  static std::unordered_map<int, const WatchingGuard*> wrapped;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(type)];
  const auto* current = slot.load();
  auto it = wrapped.find(static_cast<int>(type));
  if (current == nullptr || (it != wrapped.end() && current == it->second)) {
    return;
  }
  const auto* guard = new WatchingGuard(current);  // never destroyed, as torch's own guards
  wrapped[static_cast<int>(type)] = guard;
  slot.store(guard);
}

bool host_pinned(const void* data) {
  return at::globalContext().isPinnedPtr(data);
}

}  // namespace anydevice_races
