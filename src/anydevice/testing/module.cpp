// The Python module: the simulator's controls, and the stream race detector's Python
// side: the user's file:line for each access, and the races handed to
// anydevice.testing.races, which reports them.

#include "races.h"
#include "sim.h"

#include <c10/core/Device.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace py = pybind11;

namespace anydevice_races {
namespace {

// Where a call came from: the user's frame, and the library frame inside it, if any.
struct Site {
  std::string file;
  int line;
  std::string function;
  int inside = -1;  // the innermost library frame (site-packages) under the user's, if any
};

enum Kind : int { kIgnored = 0, kLibrary = 1, kUser = 2 };

// All of this is touched with the GIL held.
std::vector<Site> g_sites;
std::map<std::tuple<PyCodeObject*, int, int>, int> g_site_ids;
std::unordered_map<PyCodeObject*, int> g_kinds;  // holds a reference to each code object
std::vector<std::string> g_ignored;  // torch's and anydevice's folders
std::vector<std::string> g_stdlib;  // the standard library's
PyObject* g_deliver = nullptr;  // anydevice.testing.races._deliver
std::atomic<bool> g_on{false};
std::atomic<int> g_last{-1};  // the last site seen on a thread with Python frames

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

int kind_of(PyCodeObject* code) {
  auto it = g_kinds.find(code);
  if (it != g_kinds.end()) {
    return it->second;
  }
  const char* name = PyUnicode_AsUTF8(code->co_filename);
  const std::string file = name == nullptr ? "" : name;
  if (name == nullptr) {
    PyErr_Clear();
  }
  int kind = kUser;
  auto under = [&](const std::vector<std::string>& prefixes) {
    return std::any_of(prefixes.begin(), prefixes.end(), [&](const std::string& p) { return starts_with(file, p); });
  };
  if (starts_with(file, "<frozen ") || under(g_ignored)) {
    kind = kIgnored;
  } else if (file.find("/site-packages/") != std::string::npos ||
             file.find("/dist-packages/") != std::string::npos) {
    kind = kLibrary;
  } else if (under(g_stdlib)) {
    kind = kIgnored;
  }
  Py_INCREF(code);
  g_kinds.emplace(code, kind);
  return kind;
}

int intern(PyCodeObject* code, int line, int inside) {
  const auto key = std::make_tuple(code, line, inside);
  auto it = g_site_ids.find(key);
  if (it != g_site_ids.end()) {
    return it->second;
  }
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  const char* function = PyUnicode_AsUTF8(code->co_name);
  if (file == nullptr || function == nullptr) {
    PyErr_Clear();
  }
  const int id = static_cast<int>(g_sites.size());
  g_sites.push_back(Site{file ? file : "?", line, function ? function : "?", inside});
  g_site_ids.emplace(key, id);
  return id;
}

// Walks the calling thread's Python frames to the first one of the user's.
int walk() {
  PyFrameObject* frame = PyEval_GetFrame();
  Py_XINCREF(frame);
  int inside = -1;
  int found = -1;
  for (int depth = 0; frame != nullptr && depth < 64 && found < 0; ++depth) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const int kind = kind_of(code);
    if (kind == kUser) {
      found = intern(code, PyFrame_GetLineNumber(frame), inside);
    } else if (kind == kLibrary && inside < 0) {
      inside = intern(code, PyFrame_GetLineNumber(frame), -1);
    }
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(code);
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return found >= 0 ? found : inside;
}

py::dict stream_dict(const StreamRef& s) {
  py::dict d;
  d["host"] = s.host;
  d["device"] = s.device;
  d["id"] = s.id;
  d["made"] = s.made_site;
  return d;
}

}  // namespace

int capture_site() {
  if (!g_on.load(std::memory_order_relaxed)) {
    return -1;
  }
  if (PyGILState_GetThisThreadState() == nullptr) {
    return g_last.load(std::memory_order_relaxed);  // autograd's threads: the caller's last line
  }
  const PyGILState_STATE state = PyGILState_Ensure();
  const int site = walk();
  PyGILState_Release(state);
  if (site >= 0) {
    g_last.store(site, std::memory_order_relaxed);
    return site;
  }
  return g_last.load(std::memory_order_relaxed);
}

WithoutGil::WithoutGil() : saved_(nullptr) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    saved_ = PyEval_SaveThread();
  }
}

WithoutGil::~WithoutGil() {
  if (saved_ != nullptr) {
    PyEval_RestoreThread(static_cast<PyThreadState*>(saved_));
  }
}

bool python_line_calls(const char* name) {
  if (!g_on.load(std::memory_order_relaxed) || PyGILState_GetThisThreadState() == nullptr) {
    return false;
  }
  py::gil_scoped_acquire gil;
  PyFrameObject* frame = PyEval_GetFrame();
  if (frame == nullptr) {
    return false;
  }
  PyCodeObject* code = PyFrame_GetCode(frame);
  const int line = PyFrame_GetLineNumber(frame);
  static std::map<std::tuple<PyCodeObject*, int, std::string>, bool> known;
  const auto key = std::make_tuple(code, line, std::string(name));
  auto it = known.find(key);
  bool calls = false;
  if (it != known.end()) {
    calls = it->second;
    Py_DECREF(code);
  } else {
    try {
      const auto text = py::module_::import("linecache")
                            .attr("getline")(py::handle(code->co_filename), line)
                            .cast<std::string>();
      calls = text.find(std::string(name) + "(") != std::string::npos;
    } catch (const py::error_already_set&) {
      calls = false;
    }
    known.emplace(key, calls);  // keeps the reference to the code object
  }
  return calls;
}

void deliver(std::vector<Race>& races) {
  if (!g_on.load() || g_deliver == nullptr) {
    return;
  }
  py::gil_scoped_acquire gil;
  for (const Race& r : races) {
    py::dict info;
    info["kind"] = r.kind;
    info["now"] = py::dict(py::arg("stream") = stream_dict(r.now_stream), py::arg("site") = r.now_site,
                           py::arg("op") = r.now_op);
    info["before"] = py::dict(py::arg("stream") = stream_dict(r.before_stream),
                              py::arg("site") = r.before_site, py::arg("op") = r.before_op);
    info["tensor"] = r.tensor;
    info["pinned"] = r.pinned;
    info["reused"] = r.reused;
    info["freed"] = r.freed_site;
    info["hint"] = r.hint;
    info["hint_site"] = r.hint_site;
    info["hint_site2"] = r.hint_site2;
    info["hint_stream"] = stream_dict(r.hint_stream);
    info["trace"] = r.now_trace;
    PyObject* result = PyObject_CallOneArg(g_deliver, info.ptr());
    if (result == nullptr) {
      throw py::error_already_set();  // the StreamRaceError, raised where the user called
    }
    Py_DECREF(result);
  }
}

// The host's raw accesses to protected pinned memory (faults), reported.
void deliver_host_faults() {
  std::vector<Race> races;
  {
    WithoutGil unlocked;  // the detector's lock is taken without the GIL elsewhere
    for (const auto& f : anydevice_sim::take_host_faults()) {
      detector().host_fault(f.base, f.write, f.traceback, races);
    }
  }
  if (!races.empty()) {
    deliver(races);
  }
}

namespace {

// Runs in the main thread, at its next bytecode, after the signal handler asked.
int faults_pending(void* /*unused*/) {
  try {
    deliver_host_faults();
  } catch (py::error_already_set& e) {
    e.restore();
    return -1;  // the StreamRaceError, raised in the main thread
  }
  return 0;
}

void ask_for_a_look() {
  Py_AddPendingCall(&faults_pending, nullptr);
}

}  // namespace

}  // namespace anydevice_races

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace anydevice_sim;
  namespace races = anydevice_races;

  // The simulator.
  m.def("register_device", [] {
    register_device();
    register_kernels();
  });
  m.def("set_device_count", &set_device_count);
  m.def("device_count", [] { return g_device_count.load(); });
  m.def("set_bandwidth", [](double b) { g_bandwidth = b; });
  m.def("bandwidth", [] { return g_bandwidth.load(); });
  m.def("set_capacity", [](int64_t c) { g_capacity = c; });
  m.def("capacity", [] { return g_capacity.load(); });
  m.def("busy", &busy, py::arg("seconds"), py::arg("device") = -1);
  m.def("set_tracing", &set_tracing);
  m.def("take_trace", [] {
    py::list out;
    for (const auto& s : take_trace()) {
      out.append(py::make_tuple(s.what, s.device, s.stream, s.bytes, s.start, s.end));
    }
    return out;
  });

  // The race detector, for the accelerator named (the simulator's, or any other).
  m.def(
      "start_races",
      [](const std::string& device_type, bool simulated, int mode, std::vector<std::string> ignored,
         std::vector<std::string> stdlib, py::object deliver) {
        const c10::DeviceType type = c10::Device(device_type).type();
        races::g_ignored = std::move(ignored);
        races::g_stdlib = std::move(stdlib);
        Py_XDECREF(races::g_deliver);
        races::g_deliver = deliver.release().ptr();
        races::g_on = true;
        races::register_watch();
        races::watch_guard(type);
        races::detector().start(type, simulated, static_cast<races::Mode>(mode));
        if (simulated) {  // its pinned memory can be protected while copies are pending
          anydevice_sim::watch_host_faults(&races::ask_for_a_look);
          races::detector().guard_host_memory(&anydevice_sim::protect_pinned,
                                              &anydevice_sim::unprotect_pinned);
        }
      },
      py::arg("device_type"), py::arg("simulated"), py::arg("mode"), py::arg("ignored"),
      py::arg("stdlib"), py::arg("deliver"));
  m.def("set_race_mode", [](int mode) { races::detector().set_mode(static_cast<races::Mode>(mode)); });
  m.def("race_mode", [] { return static_cast<int>(races::detector().mode()); });
  m.def("watch_thread", &races::watch_thread, py::arg("on"));
  m.def("reset_races", [] { races::detector().reset(); });
  m.def("forget_reported", [] { races::detector().forget_reported(); });
  m.def("deliver_host_faults", &races::deliver_host_faults);
  m.def("stop_sites", [] { races::g_on = false; });
  m.def("site", [](int id) -> py::object {
    if (id < 0 || static_cast<size_t>(id) >= races::g_sites.size()) {
      return py::none();
    }
    const auto& s = races::g_sites[static_cast<size_t>(id)];
    return py::make_tuple(s.file, s.line, s.function, s.inside);
  });
}
