// The stream race detector's ears on operators: a dispatcher hook on every operator of
// the threads that turned it on (a thread-local dispatch key, handed to autograd's
// threads with the rest of the caller's thread-local state).
//
// For each operator it works out which blocks of memory it reads and writes (the
// schema's alias annotations: `Tensor(a!)` is written, a fresh output is written, views
// touch nothing), on which stream (the current stream of the accelerator's device it
// touches), and what the host waited for: a copy to pageable memory or a blocking copy
// waits for its stream, so do `.item()`, `equal` and operators whose output shape depends
// on the data (`nonzero`, boolean indexing), as on CUDA. Pinned host memory is read or
// written by the stream of a copy that does not block; any other operator on host memory
// is the host's own access. Composite operators are let through, and the operators they
// are made of come back here.

#include "races.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace anydevice_races {
namespace {

constexpr auto kKey = c10::DispatchKey::TESTING_ONLY_GenericMode;
constexpr int kUnset = -2;  // no composite operator around
constexpr int kLater = -3;  // inside one; its site is captured on first need

enum class Copy { none, in_place, to_copy };

struct OpInfo {
  const char* name = "";
  bool composite = false;  // made of other operators, which come back to the hook
  bool metadata = false;  // a view: reads and writes nothing
  bool shape_only = false;  // *_like, new_*: reads its arguments' shapes only
  bool empty = false;  // empty*: its output is allocated, not written
  bool record_stream = false;
  bool host_read = false;  // resolve_conj / resolve_neg: tolist() reads host memory after them
  bool syncs = false;  // the host waits for its result
  bool masks = false;  // index, index_put_: the host waits when an index is boolean
  Copy copy = Copy::none;
  int non_blocking = -1;  // the argument's position
  std::vector<bool> writes;  // per argument
  std::vector<bool> fresh;  // per return: a new tensor the operator writes
};

const char* intern(const std::string& name) {
  static std::mutex mu;
  static auto* names = new std::unordered_map<std::string, std::unique_ptr<std::string>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*names)[name];
  if (!slot) {
    slot = std::make_unique<std::string>(name);
  }
  return slot->c_str();
}

const std::unordered_set<std::string>& syncing() {
  // Operators whose CUDA kernels make the host wait: a value the host reads, or an
  // output whose size depends on the data.
  static const std::unordered_set<std::string> names = {
      "aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero",
      "aten::nonzero", "aten::nonzero_numpy", "aten::masked_select", "aten::_unique",
      "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
      "aten::unique_dim_consecutive", "aten::bincount", "aten::repeat_interleave"};
  return names;
}

// Operators that look at a tensor's metadata only, and return a number or a flag.
const std::unordered_set<std::string>& metadata_queries() {
  static const std::unordered_set<std::string> names = {
      "aten::is_pinned", "aten::is_same_size", "aten::is_set_to", "aten::_nnz",
      "aten::is_coalesced", "aten::_is_zerotensor", "aten::is_conj", "aten::is_neg",
      "aten::_has_compatible_shallow_copy_type", "aten::_debug_has_internal_overlap",
      "aten::record_stream_"};
  return names;
}

const OpInfo& info_of(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, OpInfo> known;
  const auto& schema = op.schema();
  auto it = known.find(&schema);
  if (it != known.end()) {
    return it->second;
  }
  OpInfo info;
  const std::string name = schema.operator_name().name;
  const std::string base = name.substr(name.find("::") + 2);
  info.name = intern(name);
  info.composite = op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
  info.shape_only = base.rfind("new_", 0) == 0 ||
                    (base.size() > 5 && base.compare(base.size() - 5, 5, "_like") == 0);
  info.empty = base.rfind("empty", 0) == 0 || base == "new_empty" || base == "new_empty_strided";
  info.record_stream = base == "record_stream";
  info.host_read = base == "resolve_conj" || base == "resolve_neg";
  info.syncs = syncing().count(name) > 0;
  info.masks = base == "index" || base == "index_put_" || base == "_index_put_impl_";
  if (base == "copy_") {
    info.copy = Copy::in_place;
  } else if (base == "_to_copy") {
    info.copy = Copy::to_copy;
  }
  bool writes_any = false;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& a = schema.arguments()[i];
    const bool write = a.alias_info() != nullptr && a.alias_info()->isWrite();
    info.writes.push_back(write);
    writes_any = writes_any || write;
    if (a.name() == "non_blocking") {
      info.non_blocking = static_cast<int>(i);
    }
  }
  bool views_only = !schema.returns().empty();
  for (const auto& r : schema.returns()) {
    const bool alias = r.alias_info() != nullptr;
    info.fresh.push_back(!alias);
    views_only = views_only && alias && !r.alias_info()->isWrite();
  }
  info.metadata = (views_only && !writes_any && !info.composite) || metadata_queries().count(name) > 0;
  return known.emplace(&schema, std::move(info)).first->second;
}

thread_local int t_site = kUnset;

int site_now() {
  if (t_site == kUnset) {
    return capture_site();
  }
  if (t_site == kLater) {
    t_site = capture_site();
  }
  return t_site;
}

// Inside a composite operator, the operators it is made of share its site.
struct CompositeScope {
  int saved = t_site;
  CompositeScope() {
    if (saved == kUnset) {
      t_site = kLater;
    }
  }
  ~CompositeScope() { t_site = saved; }
};

bool has_data(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data() != nullptr;
}

template <typename F>
void each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      f(t);
    }
  } else if (v.isList()) {
    for (const c10::IValue& item : v.toList()) {
      if (item.isTensor()) {
        f(item.toTensor());
      }
    }
  }
}

bool pinned(const at::Tensor& t) {
  return t.is_cpu() && has_data(t) && host_pinned(t.storage().data());
}

// The operator's accesses, gathered.
struct Accesses {
  std::vector<Use> uses;
  std::vector<at::Tensor> tensors;  // kept alive for the report, one per use

  void add(const at::Tensor& t, bool write, bool host_memory) {
    const void* key = t.storage().data();
    for (Use& u : uses) {
      if (u.key == key) {
        u.write = u.write || write;
        return;
      }
    }
    tensors.push_back(t);
    uses.push_back(Use{key, t.storage().unsafeGetStorageImpl(), nullptr, write, host_memory});
  }

  bool holds(const at::Tensor& t) const {
    for (const Use& u : uses) {
      if (u.key == t.storage().data()) {
        return true;
      }
    }
    return false;
  }

  Use* done() {
    for (size_t k = 0; k < uses.size(); ++k) {
      uses[k].tensor = &tensors[k];
    }
    return uses.data();
  }
};

c10::Stream current(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

void redispatch(const c10::OperatorHandle& op, c10::DispatchKeySet rest, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  op.redispatchBoxed(rest, stack);
}

// An index argument (after the first) of a boolean or byte mask.
bool boolean_index(const torch::jit::Stack& stack, size_t first) {
  bool found = false;
  for (size_t i = first + 1; i < stack.size(); ++i) {
    each_tensor(stack[i], [&](const at::Tensor& t) {
      found = found || (t.defined() && (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte));
    });
  }
  return found;
}

void check_host(Detector& d, Accesses& host, const char* op) {
  if (host.uses.empty()) {
    return;
  }
  std::vector<Race> races;
  Use* uses = host.done();
  d.host(uses, host.uses.size(), site_now(), op, races);
  if (!races.empty()) {
    deliver(races);
  }
}

void watch(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto rest = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
  Detector& d = detector();
  if (!d.active()) {
    redispatch(op, rest, stack);
    return;
  }
  const OpInfo& info = info_of(op);
  if (info.host_read && d.pending_host() > 0) {
    // tolist() reads a host tensor's bytes right after these two (no operator reads them).
    Accesses host;
    const at::Tensor& t = (*stack)[stack->size() - op.schema().arguments().size()].toTensor();
    if (has_data(t) && t.is_cpu()) {
      host.add(t, false, true);
      check_host(d, host, info.name);
    }
  }
  if (info.composite) {
    CompositeScope scope;
    op.redispatchBoxed(rest, stack);
    return;
  }
  const auto& schema = op.schema();
  if (info.metadata) {
    redispatch(op, rest, stack);
    return;
  }
  const size_t nargs = schema.arguments().size();
  const size_t first = stack->size() - nargs;
  const c10::DeviceType type = d.type();

  if (info.record_stream) {
    const at::Tensor& t = (*stack)[first].toTensor();
    if (has_data(t) && t.device().type() == type) {
      d.record_stream(t.storage().data(), (*stack)[first + 1].toStream());
    }
    redispatch(op, rest, stack);
    return;
  }

  // The arguments: device memory the operator's stream reads or writes, host memory the
  // host does (pinned blocks with copies pending are all that matter there).
  Accesses dev, host;
  std::optional<c10::Device> device, target;  // target: a device argument
  at::Tensor src, dst;  // a copy's sides
  const bool host_pending = d.pending_host() > 0;
  const c10::IValue* nb = info.non_blocking >= 0 ? &(*stack)[first + static_cast<size_t>(info.non_blocking)] : nullptr;
  const bool non_blocking = nb != nullptr && nb->isBool() && nb->toBool();
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& arg = (*stack)[first + i];
    if (arg.isDevice() && arg.toDevice().type() == type && !target) {
      const c10::Device where = arg.toDevice();
      target = where.has_index() ? where : c10::Device(type, c10::impl::getDeviceGuardImpl(type)->getDevice().index());
      device = device ? device : target;
    }
    each_tensor(arg, [&](const at::Tensor& t) {
      if (!has_data(t)) {
        return;
      }
      if (info.copy == Copy::in_place) {
        (i == 0 ? dst : src) = t;
      } else if (info.copy == Copy::to_copy && i == 0) {
        src = t;
      }
      const bool write = info.writes[i];
      if (!write && info.shape_only) {
        return;
      }
      if (t.device().type() == type) {
        device = device ? device : t.device();
        if (info.copy == Copy::none) {
          dev.add(t, write, false);
        }
      } else if (t.is_cpu() && host_pending) {
        host.add(t, write, true);
      }
    });
  }
  if (!device) {
    check_host(d, host, info.name);  // the host's own operator
    redispatch(op, rest, stack);
    return;
  }
  if (info.copy == Copy::none) {
    check_host(d, host, info.name);  // host scalars read at the launch
  }

  const int site = site_now();
  const c10::Stream stream = current(*device);
  // A copy between two devices orders the current streams of both (CUDA's two-way barrier):
  // `other` is the device whose stream does not run it.
  std::optional<c10::Device> other;
  if (info.copy == Copy::in_place && src.defined() && src.device().type() == type &&
      src.device() != *device) {
    other = src.device();
  } else if (info.copy == Copy::to_copy && target && *target != *device) {
    other = target;
  }
  if (other) {
    d.stream_waited(stream, current(*other));
  }
  bool post_wait = info.syncs || (info.masks && boolean_index(*stack, first));
  if (info.copy != Copy::none) {
    // A copy: pinned host memory is the stream's to read or write (pageable memory the
    // host copies through a staging buffer at once); a blocking copy, or one to pageable
    // memory, makes the host wait for the stream.
    if (src.is_cpu()) {
      if (pinned(src)) {
        dev.add(src, false, true);
      } else if (non_blocking) {
        d.host_waited(stream, site);  // CUDA's driver waits for the stream before staging
      }
    } else {
      if (src.device() != *device) {
        d.host_waited(current(src.device()), site);  // across devices: the source's stream first
      }
      dev.add(src, false, false);
    }
    if (dst.defined() && !dst.is_cpu()) {
      dev.add(dst, true, false);
    }
    post_wait = post_wait || !non_blocking;
  }

  redispatch(op, rest, stack);

  // Fresh outputs are written by the operator (a view of an argument is not fresh).
  const size_t nret = schema.returns().size();
  const size_t rfirst = stack->size() - nret;
  for (size_t i = 0; i < nret; ++i) {
    each_tensor((*stack)[rfirst + i], [&](const at::Tensor& t) {
      if (!has_data(t) || !info.fresh[i] || dev.holds(t)) {
        return;
      }
      if (info.copy == Copy::to_copy && i == 0) {
        dst = t;
      }
      if (t.device().type() == type && !info.empty) {
        dev.add(t, true, false);
      }
    });
  }
  if (info.copy != Copy::none && dst.defined() && dst.is_cpu()) {
    if (non_blocking && pinned(dst)) {
      dev.add(dst, true, true);  // written by the stream, later
    } else {
      post_wait = true;  // to pageable memory: the host waited for the copy
    }
  }

  std::vector<Race> races;
  d.kernel(stream, dev.done(), dev.uses.size(), site, info.name, races);
  if (other) {
    d.stream_waited(current(*other), stream);  // across devices: both streams after the copy
  }
  if (post_wait) {
    d.host_waited(stream, site);
  }
  if (!races.empty()) {
    deliver(races);
  }
}

}  // namespace

void watch_thread(bool on) {
  c10::impl::tls_set_dispatch_key_included(kKey, on);
}

void register_watch() {
  static bool done = false;
  if (done) {
    return;
  }
  done = true;
  auto* lib = new torch::Library(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
  lib->fallback(torch::CppFunction::makeFromBoxedFunction<&watch>());
}

}  // namespace anydevice_races
