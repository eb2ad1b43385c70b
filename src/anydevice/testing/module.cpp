// The Python module: the simulator's controls, and the stream race detector's Python
// side: the user's file:line for each access, and the races handed to
// anydevice.testing.races, which reports them.
//
// Written with Python's C API alone: pybind11's headers cost more compile time than all the
// rest of this file (see raise_through_torch for the one thing they were needed for).

#include "races.h"
#include "sim.h"

#include <Python.h>
#include <c10/core/Device.h>
#include <c10/core/impl/PyInterpreterHooks.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

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

// Holds one reference to a Python object (none: nullptr) and lets go of it at the end.
class Ref {
 public:
  explicit Ref(PyObject* object = nullptr) : object_(object) {}
  ~Ref() { Py_XDECREF(object_); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return object_; }
  PyObject* release() {
    PyObject* object = object_;
    object_ = nullptr;
    return object;
  }

 private:
  PyObject* object_;
};

// The GIL, held for a block (by any thread, Python's or not).
class WithGil {
 public:
  WithGil() : state_(PyGILState_Ensure()) {}
  ~WithGil() { PyGILState_Release(state_); }
  WithGil(const WithGil&) = delete;
  WithGil& operator=(const WithGil&) = delete;

 private:
  PyGILState_STATE state_;
};

// Sets `key` of `dict` to `value` (a new reference, taken); false when `value` is null
// (a Python error is set) or the dict refused it.
bool put(PyObject* dict, const char* key, PyObject* value) {
  Ref owned(value);
  return value != nullptr && PyDict_SetItemString(dict, key, value) == 0;
}

PyObject* text(const std::string& s) {
  return PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
}

// A new dict, or nullptr with a Python error set.
PyObject* stream_dict(const StreamRef& s) {
  Ref d(PyDict_New());
  if (d.get() == nullptr || !put(d.get(), "host", PyBool_FromLong(s.host)) ||
      !put(d.get(), "device", text(s.device)) || !put(d.get(), "id", PyLong_FromLongLong(s.id)) ||
      !put(d.get(), "made", PyLong_FromLong(s.made_site))) {
    return nullptr;
  }
  return d.release();
}

// The accesses of one side of a race: {"stream": ..., "site": ..., "op": ...}.
PyObject* side_dict(const StreamRef& stream, int site, const std::string& op) {
  Ref d(PyDict_New());
  if (d.get() == nullptr || !put(d.get(), "stream", stream_dict(stream)) ||
      !put(d.get(), "site", PyLong_FromLong(site)) || !put(d.get(), "op", text(op))) {
    return nullptr;
  }
  return d.release();
}

PyObject* race_dict(const Race& r) {
  Ref info(PyDict_New());
  if (info.get() == nullptr || !put(info.get(), "kind", text(r.kind)) ||
      !put(info.get(), "now", side_dict(r.now_stream, r.now_site, r.now_op)) ||
      !put(info.get(), "before", side_dict(r.before_stream, r.before_site, r.before_op)) ||
      !put(info.get(), "tensor", text(r.tensor)) ||
      !put(info.get(), "pinned", PyBool_FromLong(r.pinned)) ||
      !put(info.get(), "reused", PyBool_FromLong(r.reused)) ||
      !put(info.get(), "freed", PyLong_FromLong(r.freed_site)) ||
      !put(info.get(), "hint", text(r.hint)) ||
      !put(info.get(), "hint_site", PyLong_FromLong(r.hint_site)) ||
      !put(info.get(), "hint_site2", PyLong_FromLong(r.hint_site2)) ||
      !put(info.get(), "hint_stream", stream_dict(r.hint_stream)) ||
      !put(info.get(), "trace", text(r.now_trace))) {
    return nullptr;
  }
  return info.release();
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
  WithGil gil;
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
    Ref linecache(PyImport_ImportModule("linecache"));
    Ref source(linecache.get() == nullptr ? nullptr
                                          : PyObject_CallMethod(linecache.get(), "getline", "Oi",
                                                                code->co_filename, line));
    Py_ssize_t size = 0;
    const char* chars = source.get() != nullptr && PyUnicode_Check(source.get())
                            ? PyUnicode_AsUTF8AndSize(source.get(), &size)
                            : nullptr;
    if (chars == nullptr) {
      PyErr_Clear();
    } else {
      calls = std::string(chars, static_cast<size_t>(size)).find(std::string(name) + "(") !=
              std::string::npos;
    }
    known.emplace(key, calls);  // keeps the reference to the code object
  }
  return calls;
}

namespace {

#if PY_VERSION_HEX >= 0x030C0000
// Raises the exception it holds (`self`).
PyObject* raise_held(PyObject* self, PyObject* /*key*/) {
  Py_INCREF(self);
  PyErr_SetRaisedException(self);
  return nullptr;
}
#else
// Raises the exception it holds (`self`: its type, value and traceback, None where unset).
PyObject* raise_held(PyObject* self, PyObject* /*key*/) {
  PyObject* parts[3];
  for (Py_ssize_t i = 0; i < 3; ++i) {
    parts[i] = PyTuple_GET_ITEM(self, i);
    parts[i] = parts[i] == Py_None ? nullptr : parts[i];
    Py_XINCREF(parts[i]);
  }
  PyErr_Restore(parts[0], parts[1], parts[2]);
  return nullptr;
}
#endif

PyMethodDef g_raise_held = {
    "raise_held", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&raise_held)), METH_O,
    nullptr};

// Raises the Python exception set now (the GIL held) through the C++ code that called in,
// as the C++ exception torch's Python bindings turn back into the Python exception it
// carries (pybind11's error_already_set), so that a StreamRaceError reaches the user's line
// through torch's operators. torch's Python hooks throw it: `reportErrorCallback` calls a
// Python function (here one that raises the exception) and throws it when the function
// raises. Throwing it here would take pybind11's headers, which cost more compile time than
// all the rest of this file.
[[noreturn]] void raise_through_torch() {
#if PY_VERSION_HEX >= 0x030C0000
  Ref held(PyErr_GetRaisedException());
#else
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  auto or_none = [](PyObject* o) {
    if (o == nullptr) {
      Py_INCREF(Py_None);
      return Py_None;
    }
    return o;
  };
  Ref held(PyTuple_Pack(3, or_none(type), or_none(value), or_none(trace)));
  for (PyObject* o : {type, value, trace}) {
    Py_XDECREF(o == nullptr ? Py_None : o);
  }
#endif
  Ref raise(held.get() == nullptr ? nullptr : PyCFunction_New(&g_raise_held, held.get()));
  c10::impl::PyInterpreter* python = c10::impl::getGlobalPyInterpreter();
  if (raise.get() != nullptr && python != nullptr) {
    (*python)->reportErrorCallback(raise.get(), c10::DispatchKey::PrivateUse1);  // throws
  }
  throw std::runtime_error(
      "anydevice.testing: a stream race report could not be raised through torch (no Python "
      "interpreter hooks in torch); run with races='warn'");
}

// Hands races to the Python side, the GIL held; false when it raised (the exception set).
bool hand_over(const std::vector<Race>& races) {
  for (const Race& r : races) {
    Ref info(race_dict(r));
    Ref result(info.get() == nullptr ? nullptr : PyObject_CallOneArg(g_deliver, info.get()));
    if (result.get() == nullptr) {
      return false;  // the StreamRaceError
    }
  }
  return true;
}

// The host's raw accesses to protected pinned memory (faults), reported; false when that
// raised (the exception set). The GIL held.
bool deliver_host_faults() {
  std::vector<Race> races;
  {
    WithoutGil unlocked;  // the detector's lock is taken without the GIL elsewhere
    for (const auto& f : anydevice_sim::take_host_faults()) {
      detector().host_fault(f.base, f.write, f.traceback, races);
    }
  }
  return races.empty() || !g_on.load() || g_deliver == nullptr || hand_over(races);
}

// Runs in the main thread, at its next bytecode, after the signal handler asked.
int faults_pending(void* /*unused*/) {
  try {
    return deliver_host_faults() ? 0 : -1;  // -1: the StreamRaceError, raised in the main thread
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
}

void ask_for_a_look() {
  Py_AddPendingCall(&faults_pending, nullptr);
}

}  // namespace

void deliver(std::vector<Race>& races) {
  if (!g_on.load() || g_deliver == nullptr) {
    return;
  }
  WithGil gil;
  if (!hand_over(races)) {
    raise_through_torch();  // the StreamRaceError, raised where the user called
  }
}

// ---------------------------------------------------------------------------
// The module's functions: each takes its arguments as Python's C API parses them (the
// Python side checks their values first) and turns a C++ exception into Python's.

namespace {

using namespace anydevice_sim;
namespace races = anydevice_races;  // as the Python side names them

// Runs `body` (which returns a new reference, or nullptr with a Python error set); a C++
// exception becomes a Python RuntimeError: torch's errors (TORCH_CHECK) with their message,
// as torch's bindings make them.
template <typename Body>
PyObject* guarded(Body body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyObject* none() {
  Py_RETURN_NONE;
}

// The positional and keyword arguments of a function, parsed by `format`.
template <typename... Out>
bool parse(PyObject* args, PyObject* kwargs, const char* format, const char* const* names,
           Out*... out) {
  return PyArg_ParseTupleAndKeywords(args, kwargs, format, const_cast<char**>(names), out...) != 0;
}

// A list of str as strings; false (a Python error set) for anything else.
bool strings(PyObject* list, std::vector<std::string>& out) {
  if (!PyList_Check(list)) {
    PyErr_SetString(PyExc_TypeError, "expected a list of str");
    return false;
  }
  out.clear();
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) {
    PyObject* item = PyList_GET_ITEM(list, i);
    Py_ssize_t size = 0;
    const char* chars = PyUnicode_Check(item) ? PyUnicode_AsUTF8AndSize(item, &size) : nullptr;
    if (chars == nullptr) {
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "expected a list of str");
      }
      return false;
    }
    out.emplace_back(chars, static_cast<size_t>(size));
  }
  return true;
}

// The simulator.

PyObject* py_register_device(PyObject*, PyObject*) {
  return guarded([] {
    register_device();
    register_kernels();
    return none();
  });
}

PyObject* py_set_device_count(PyObject*, PyObject* arg) {
  const long n = PyLong_AsLong(arg);
  if (n == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (n < INT_MIN || n > INT_MAX) {
    PyErr_Format(PyExc_OverflowError, "set_device_count(): %ld is out of range", n);
    return nullptr;
  }
  return guarded([n] {
    set_device_count(static_cast<int>(n));
    return none();
  });
}

PyObject* py_device_count(PyObject*, PyObject*) {
  return PyLong_FromLong(g_device_count.load());
}

PyObject* py_set_bandwidth(PyObject*, PyObject* arg) {
  const double b = PyFloat_AsDouble(arg);
  if (b == -1.0 && PyErr_Occurred()) {
    return nullptr;
  }
  g_bandwidth = b;
  return none();
}

PyObject* py_bandwidth(PyObject*, PyObject*) {
  return PyFloat_FromDouble(g_bandwidth.load());
}

PyObject* py_set_capacity(PyObject*, PyObject* arg) {
  const long long c = PyLong_AsLongLong(arg);
  if (c == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  g_capacity = c;
  return none();
}

PyObject* py_capacity(PyObject*, PyObject*) {
  return PyLong_FromLongLong(g_capacity.load());
}

PyObject* py_busy(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* const names[] = {"seconds", "device", nullptr};
  double seconds = 0;
  int device = -1;
  if (!parse(args, kwargs, "d|i:busy", names, &seconds, &device)) {
    return nullptr;
  }
  return guarded([seconds, device] {
    busy(seconds, device);
    return none();
  });
}

PyObject* py_set_tracing(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) {
    return nullptr;
  }
  set_tracing(on != 0);
  return none();
}

PyObject* py_take_trace(PyObject*, PyObject*) {
  return guarded([]() -> PyObject* {
    const auto spans = take_trace();
    Ref out(PyList_New(static_cast<Py_ssize_t>(spans.size())));
    if (out.get() == nullptr) {
      return nullptr;
    }
    for (size_t i = 0; i < spans.size(); ++i) {
      const auto& s = spans[i];
      PyObject* span = Py_BuildValue("(NiLLdd)", text(s.what), s.device,
                                     static_cast<long long>(s.stream),
                                     static_cast<long long>(s.bytes), s.start, s.end);
      if (span == nullptr) {
        return nullptr;
      }
      PyList_SET_ITEM(out.get(), static_cast<Py_ssize_t>(i), span);
    }
    return out.release();
  });
}

// The race detector, for the accelerator named (the simulator's, or any other).

PyObject* py_start_races(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* const names[] = {"device_type", "simulated", "mode", "ignored",
                                      "stdlib", "deliver", nullptr};
  const char* device_type = nullptr;
  int simulated = 0, mode = 0;
  PyObject* ignored = nullptr;
  PyObject* stdlib = nullptr;
  PyObject* deliver = nullptr;
  if (!parse(args, kwargs, "spiOOO:start_races", names, &device_type, &simulated, &mode, &ignored,
             &stdlib, &deliver)) {
    return nullptr;
  }
  std::vector<std::string> ignored_folders, stdlib_folders;
  if (!strings(ignored, ignored_folders) || !strings(stdlib, stdlib_folders)) {
    return nullptr;
  }
  return guarded([&] {
    const c10::DeviceType type = c10::Device(device_type).type();
    races::g_ignored = std::move(ignored_folders);
    races::g_stdlib = std::move(stdlib_folders);
    Py_INCREF(deliver);
    Py_XDECREF(races::g_deliver);
    races::g_deliver = deliver;
    races::g_on = true;
    races::register_watch();
    races::watch_guard(type);
    races::detector().start(type, simulated != 0, static_cast<races::Mode>(mode));
    if (simulated != 0) {  // its pinned memory can be protected while copies are pending
      watch_host_faults(&races::ask_for_a_look);
      races::detector().guard_host_memory(&protect_pinned, &unprotect_pinned);
    }
    return none();
  });
}

PyObject* py_set_race_mode(PyObject*, PyObject* arg) {
  const long mode = PyLong_AsLong(arg);
  if (mode == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  races::detector().set_mode(static_cast<races::Mode>(mode));
  return none();
}

PyObject* py_race_mode(PyObject*, PyObject*) {
  return PyLong_FromLong(static_cast<int>(races::detector().mode()));
}

PyObject* py_watch_thread(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* const names[] = {"on", nullptr};
  int on = 0;
  if (!parse(args, kwargs, "p:watch_thread", names, &on)) {
    return nullptr;
  }
  return guarded([on] {
    races::watch_thread(on != 0);
    return none();
  });
}

PyObject* py_reset_races(PyObject*, PyObject*) {
  return guarded([] {
    races::detector().reset();
    return none();
  });
}

PyObject* py_forget_reported(PyObject*, PyObject*) {
  return guarded([] {
    races::detector().forget_reported();
    return none();
  });
}

PyObject* py_deliver_host_faults(PyObject*, PyObject*) {
  return guarded([] { return races::deliver_host_faults() ? none() : nullptr; });
}

PyObject* py_stop_sites(PyObject*, PyObject*) {
  races::g_on = false;
  return none();
}

PyObject* py_site(PyObject*, PyObject* arg) {
  const long id = PyLong_AsLong(arg);
  if (id == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (id < 0 || static_cast<size_t>(id) >= races::g_sites.size()) {
    return none();
  }
  const auto& s = races::g_sites[static_cast<size_t>(id)];
  return Py_BuildValue("(NiNi)", text(s.file), s.line, text(s.function), s.inside);
}

template <typename F>
PyCFunction fn(F f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef g_methods[] = {
    {"register_device", fn(py_register_device), METH_NOARGS, nullptr},
    {"set_device_count", fn(py_set_device_count), METH_O, nullptr},
    {"device_count", fn(py_device_count), METH_NOARGS, nullptr},
    {"set_bandwidth", fn(py_set_bandwidth), METH_O, nullptr},
    {"bandwidth", fn(py_bandwidth), METH_NOARGS, nullptr},
    {"set_capacity", fn(py_set_capacity), METH_O, nullptr},
    {"capacity", fn(py_capacity), METH_NOARGS, nullptr},
    {"busy", fn(py_busy), METH_VARARGS | METH_KEYWORDS, nullptr},
    {"set_tracing", fn(py_set_tracing), METH_O, nullptr},
    {"take_trace", fn(py_take_trace), METH_NOARGS, nullptr},
    {"start_races", fn(py_start_races), METH_VARARGS | METH_KEYWORDS, nullptr},
    {"set_race_mode", fn(py_set_race_mode), METH_O, nullptr},
    {"race_mode", fn(py_race_mode), METH_NOARGS, nullptr},
    {"watch_thread", fn(py_watch_thread), METH_VARARGS | METH_KEYWORDS, nullptr},
    {"reset_races", fn(py_reset_races), METH_NOARGS, nullptr},
    {"forget_reported", fn(py_forget_reported), METH_NOARGS, nullptr},
    {"deliver_host_faults", fn(py_deliver_host_faults), METH_NOARGS, nullptr},
    {"stop_sites", fn(py_stop_sites), METH_NOARGS, nullptr},
    {"site", fn(py_site), METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

#define ANYDEVICE_TEXT_(x) #x
#define ANYDEVICE_TEXT(x) ANYDEVICE_TEXT_(x)
#define ANYDEVICE_JOIN_(a, b) a##b
#define ANYDEVICE_JOIN(a, b) ANYDEVICE_JOIN_(a, b)

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, ANYDEVICE_TEXT(TORCH_EXTENSION_NAME), nullptr, -1,
                        g_methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

}  // namespace anydevice_races

// The module's entry point, PyInit_<TORCH_EXTENSION_NAME>.
PyMODINIT_FUNC ANYDEVICE_JOIN(PyInit_, TORCH_EXTENSION_NAME)() {
  return PyModule_Create(&anydevice_races::g_module);
}
