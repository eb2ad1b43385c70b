// The simulator's pinned host memory, and the host's reads of it that no operator makes.
//
// Pinned memory is ordinary host memory this backend knows as pinned, so copies from it
// (and to it) may run asynchronously, as page-locked memory does on a GPU. Each block is
// mapped twice: the host's mapping (what tensors point to) and the device's (what the
// streams' workers copy through). While a copy into or out of a block is pending and the
// host has not waited for it, the race detector makes the host's mapping inaccessible
// (for a pending write) or read-only (for a pending read): then *any* access of the host's
// — `.numpy()`, the buffer protocol, `torch.save` — faults, and the fault is a race the
// detector reports with the Python traceback of the thread that made it (taken in the
// signal handler, as faulthandler does), after letting the access go on. Accesses by
// torch's operators are seen by the detector before they happen (watch.cpp); this catches
// the rest.
//
// Where memfd or the second mapping is not available, blocks are single mappings and are
// never protected: the operators' accesses are still checked.

#include "sim.h"

#include <Python.h>
#include <c10/core/impl/alloc_cpu.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

namespace anydevice_sim {
namespace {

struct Mapping {
  char* host;  // what tensors point to
  char* device;  // what the workers copy through (== host where unmapped twice)
  size_t size;  // the mappings' size, whole pages
};

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

// ---------------------------------------------------------------------------
// The protected blocks, read by the signal handler without a lock.

constexpr int kSlots = 4096;

struct Slot {
  std::atomic<uintptr_t> base{0};
  std::atomic<size_t> size{0};
  std::atomic<bool> no_reads{false};  // PROT_NONE (a write pending), else read-only
};

Slot g_slots[kSlots];
std::mutex g_slots_mutex;  // protect/unprotect (not the handler)

// Faults the handler saw, and the tracebacks it wrote, for the next look.
constexpr int kFaults = 64;
struct FaultRecord {
  uintptr_t base;
  bool write;
  bool no_reads;
};
FaultRecord g_faults[kFaults];
std::atomic<int> g_fault_claimed{0};  // records being written
std::atomic<int> g_fault_count{0};  // records written
int g_trace_pipe[2] = {-1, -1};
void (*g_dump_traceback)(int, PyThreadState*) = nullptr;  // CPython's, as faulthandler uses
void (*g_on_fault)() = nullptr;  // asks the Python side to look (Py_AddPendingCall)
struct sigaction g_previous;
std::atomic<bool> g_handler_installed{false};

bool write_fault(void* context) {
#if defined(__x86_64__)
  const auto* uc = static_cast<ucontext_t*>(context);
  return (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#else
  (void)context;
  return false;  // not known: a read, unless the block was read-only
#endif
}

void write_all(int fd, const char* text) {
  const size_t n = strlen(text);
  ssize_t done = write(fd, text, n);
  (void)done;
}

void on_segv(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (int i = 0; i < kSlots; ++i) {
    const uintptr_t base = g_slots[i].base.load(std::memory_order_acquire);
    if (base == 0 || addr < base || addr >= base + g_slots[i].size.load()) {
      continue;
    }
    const bool no_reads = g_slots[i].no_reads.load();
    // Let the access go on (it is the program's), and report it.
    mprotect(reinterpret_cast<void*>(base), g_slots[i].size.load(), PROT_READ | PROT_WRITE);
    g_slots[i].base.store(0, std::memory_order_release);
    const int k = g_fault_claimed.fetch_add(1);
    if (k < kFaults) {
      g_faults[k] = FaultRecord{base, !no_reads || write_fault(context), no_reads};
      if (g_trace_pipe[1] >= 0) {
        char header[64];
        snprintf(header, sizeof(header), "\n@@fault %d\n", k);
        write_all(g_trace_pipe[1], header);
        PyThreadState* tstate = PyGILState_GetThisThreadState();
        if (g_dump_traceback != nullptr && tstate != nullptr) {
          g_dump_traceback(g_trace_pipe[1], tstate);
        }
      }
    }
    g_fault_count.fetch_add(1, std::memory_order_release);
    if (g_on_fault != nullptr) {
      g_on_fault();
    }
    return;
  }
  // Not ours: whoever handled SIGSEGV before (faulthandler, the default's core dump).
  if (g_previous.sa_flags & SA_SIGINFO) {
    g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler == SIG_DFL || g_previous.sa_handler == SIG_IGN) {
    signal(sig, SIG_DFL);  // the access runs again and ends the process as it would have
  } else {
    g_previous.sa_handler(sig);
  }
}

// Makes the handler the first for SIGSEGV (again, if something installed another since).
void ensure_handler() {
  struct sigaction current;
  sigaction(SIGSEGV, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == &on_segv) {
    return;
  }
  struct sigaction mine;
  std::memset(&mine, 0, sizeof(mine));
  mine.sa_sigaction = &on_segv;
  mine.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&mine.sa_mask);
  g_previous = current;
  sigaction(SIGSEGV, &mine, nullptr);
  g_handler_installed = true;
}

// ---------------------------------------------------------------------------
// The allocator.

class PinnedMemory final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    if (bytes == 0) {
      return {nullptr, nullptr, &PinnedMemory::release, c10::Device(c10::DeviceType::CPU)};
    }
    Mapping m = map(bytes);
    // Poisoned too: a pinned buffer read before its device-to-host copy landed shows
    // NaN, where a reused buffer on a GPU shows an older batch.
    std::memset(m.host, 0xFF, bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[reinterpret_cast<uintptr_t>(m.host)] = m;
    }
    return {m.host, m.host, &PinnedMemory::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &PinnedMemory::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // The block holding ptr (a view into one is pinned too).
  bool find(const void* ptr, Mapping* out) {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) {
      return false;
    }
    --it;
    if (p >= it->first + it->second.size) {
      return false;
    }
    *out = it->second;
    return true;
  }

  static void release(void* data);

  void forget(void* data) {
    Mapping m{};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = blocks_.find(reinterpret_cast<uintptr_t>(data));
      if (it == blocks_.end()) {
        return;
      }
      m = it->second;
      blocks_.erase(it);
    }
    unprotect_pinned(m.host);
    if (m.device == m.host) {
      c10::free_cpu(m.host);
    } else {
      munmap(m.host, m.size);
      munmap(m.device, m.size);
    }
  }

 private:
  static Mapping map(size_t bytes) {
    const size_t size = (bytes + page_size() - 1) / page_size() * page_size();
    const int fd = memfd_create("anydevice-pinned", MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) == 0) {
      void* host = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      void* device = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (host != MAP_FAILED && device != MAP_FAILED) {
        return Mapping{static_cast<char*>(host), static_cast<char*>(device), size};
      }
      if (host != MAP_FAILED) {
        munmap(host, size);
      }
      if (device != MAP_FAILED) {
        munmap(device, size);
      }
    } else if (fd >= 0) {
      close(fd);
    }
    char* data = static_cast<char*>(c10::alloc_cpu(bytes));
    return Mapping{data, data, bytes};
  }

  std::mutex mutex_;
  std::map<uintptr_t, Mapping> blocks_;
};

PinnedMemory& pinned() {
  static auto* memory = new PinnedMemory();  // never destroyed: frees at exit
  return *memory;
}

void PinnedMemory::release(void* data) {
  pinned().forget(data);
}

}  // namespace

c10::Allocator* pinned_allocator() {
  return &pinned();
}

bool is_pinned_ptr(const void* ptr) {
  Mapping m{};
  return ptr != nullptr && pinned().find(ptr, &m);
}

bool is_pinned(const at::TensorBase& t) {
  return t.is_cpu() && t.has_storage() && is_pinned_ptr(t.storage().data());
}

void* pinned_alias(const void* ptr) {
  Mapping m{};
  if (ptr == nullptr || !pinned().find(ptr, &m)) {
    return const_cast<void*>(ptr);
  }
  return m.device + (static_cast<const char*>(ptr) - m.host);
}

void protect_pinned(const void* base, bool no_reads) {
  Mapping m{};
  if (!pinned().find(base, &m) || m.device == m.host || m.host != base) {
    return;  // not a block of its own mapping: nothing to protect
  }
  std::lock_guard<std::mutex> lock(g_slots_mutex);
  ensure_handler();
  int free = -1;
  for (int i = 0; i < kSlots; ++i) {
    const uintptr_t b = g_slots[i].base.load();
    if (b == reinterpret_cast<uintptr_t>(base)) {
      free = i;
      break;
    }
    if (b == 0 && free < 0) {
      free = i;
    }
  }
  if (free < 0) {
    return;  // more blocks pending than slots: this one goes unwatched
  }
  Slot& slot = g_slots[free];
  slot.size.store(m.size);
  slot.no_reads.store(no_reads);
  slot.base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
  mprotect(m.host, m.size, no_reads ? PROT_NONE : PROT_READ);
}

void unprotect_pinned(const void* base) {
  std::lock_guard<std::mutex> lock(g_slots_mutex);
  for (int i = 0; i < kSlots; ++i) {
    if (g_slots[i].base.load() == reinterpret_cast<uintptr_t>(base)) {
      mprotect(const_cast<void*>(base), g_slots[i].size.load(), PROT_READ | PROT_WRITE);
      g_slots[i].base.store(0, std::memory_order_release);
    }
  }
}

void watch_host_faults(void (*on_fault)()) {
  if (g_trace_pipe[0] < 0 && pipe2(g_trace_pipe, O_NONBLOCK | O_CLOEXEC) != 0) {
    g_trace_pipe[0] = g_trace_pipe[1] = -1;
  }
  g_dump_traceback = reinterpret_cast<void (*)(int, PyThreadState*)>(
      dlsym(RTLD_DEFAULT, "_Py_DumpTraceback"));
  g_on_fault = on_fault;
}

std::vector<HostFault> take_host_faults() {
  std::vector<HostFault> out;
  const int count = g_fault_count.load(std::memory_order_acquire);
  if (count == 0 || count != g_fault_claimed.load()) {
    return out;  // none, or one being written: the next look takes it
  }
  g_fault_count.store(0);
  g_fault_claimed.store(0);
  const int n = std::min(count, kFaults);
  std::string text;
  if (g_trace_pipe[0] >= 0) {
    char buffer[4096];
    ssize_t got;
    while ((got = read(g_trace_pipe[0], buffer, sizeof(buffer))) > 0) {
      text.append(buffer, static_cast<size_t>(got));
    }
  }
  for (int k = 0; k < n; ++k) {
    HostFault f{reinterpret_cast<const void*>(g_faults[k].base), g_faults[k].write, ""};
    const std::string marker = "\n@@fault " + std::to_string(k) + "\n";
    const size_t at = text.find(marker);
    if (at != std::string::npos) {
      const size_t start = at + marker.size();
      const size_t end = text.find("\n@@fault ", start);
      f.traceback = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    }
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace anydevice_sim
