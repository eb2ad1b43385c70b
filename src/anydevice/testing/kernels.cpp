// The simulated accelerator's operators.
//
// Every operator without a kernel of its own here runs torch's CPU kernel on the device
// memory, asynchronously, on the current stream's worker, as a GPU runs a kernel:
//
// - On the host, torch's meta kernel gives the outputs' shapes and dtypes (and checks the
//   arguments, as a GPU's launch does); outputs are allocated on the current stream, and
//   the kernel is queued there. The host returns at once: it runs ahead of the device, a
//   kernel reads its inputs when the worker gets to it, and a stream that did not wait
//   reads whatever is in memory then.
// - The host waits instead where a GPU's host waits too: an operator whose result the
//   host reads (`.item()`, `equal`) or whose output shape depends on the data (`nonzero`,
//   `masked_select`, boolean indexing). Random operators also run on the host, after
//   their stream, so that they draw from the CPU's generator in program order; and so
//   do the few operators torch has no meta kernel for.
// - Copies follow CUDA's rules (see copy_from).
//
// The worker holds no reference to device memory: a tensor freed while a kernel that
// uses it is still queued goes back to the allocator at once, as on a GPU (memory.cpp
// says when it can be handed out again).

#include "boxed.h"
#include "sim.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <unordered_map>

namespace anydevice_sim {
namespace {

using Stack = std::vector<c10::IValue>;

// ---------------------------------------------------------------------------
// Views of device memory for the host's kernels, and of shapes for the meta kernels.

// A CPU tensor over the bytes of a device storage, owning neither (the device tensor
// does, or did: a queued kernel may outlive it, as on a GPU).
at::Tensor host_view(const c10::Storage& storage, const at::Tensor& like, c10::Storage* shared) {
  if (!*shared) {
    *shared = c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(),
                           c10::DataPtr(storage.mutable_data(), c10::Device(c10::DeviceType::CPU)),
                           nullptr, /*resizable=*/false);
  }
  auto view = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(*shared), c10::DispatchKeySet(c10::DispatchKey::CPU), like.dtype());
  view.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                     like.storage_offset());
  return view;
}

at::Tensor meta_view(const at::Tensor& like, c10::Storage* shared) {
  if (!*shared) {
    *shared = c10::Storage(c10::Storage::use_byte_size_t(), like.storage().nbytes(),
                           c10::DataPtr(nullptr, c10::Device(c10::DeviceType::Meta)),
                           c10::GetAllocator(c10::DeviceType::Meta), /*resizable=*/true);
  }
  auto view = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(*shared), c10::DispatchKeySet(c10::DispatchKey::Meta), like.dtype());
  view.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                     like.storage_offset());
  return view;
}

// Another tensor over `t`'s storage, with its shape.
at::Tensor same_bytes(const at::Tensor& t) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(),
                                                      t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return out;
}

// A device tensor over a device storage, with the given shape.
at::Tensor device_view(const at::Tensor& base, const at::Tensor& shape) {
  auto view = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()),
                                                       base.key_set(), shape.dtype());
  view.unsafeGetTensorImpl()->set_sizes_and_strides(shape.sizes(), shape.strides(),
                                                     shape.storage_offset());
  return view;
}

at::Tensor empty_on(c10::Device device, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                    c10::ScalarType dtype) {
  const c10::DeviceGuard guard(device);
  return at::detail::empty_strided_generic(sizes, strides, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           dtype);
}

// Converts every tensor in an argument (a tensor, a list of them, optional ones).
template <typename F>
c10::IValue map_tensors(const c10::IValue& arg, F&& f) {
  if (arg.isTensor()) {
    return f(arg.toTensor());
  }
  if (arg.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : arg.toTensorList()) {
      out.push_back(f(t));
    }
    return out;
  }
  if (arg.isList()) {
    auto list = arg.toList();
    c10::impl::GenericList out(list.elementType());
    for (const c10::IValue& item : list) {
      out.push_back(item.isTensor() ? c10::IValue(f(item.toTensor())) : item);
    }
    return out;
  }
  return arg;
}

template <typename F>
void each_tensor(const c10::IValue& arg, F&& f) {
  if (arg.isTensor()) {
    f(arg.toTensor());
  } else if (arg.isTensorList()) {
    for (const at::Tensor& t : arg.toTensorList()) {
      f(t);
    }
  } else if (arg.isList()) {
    for (const c10::IValue& item : arg.toList()) {
      if (item.isTensor()) {
        f(item.toTensor());
      }
    }
  }
}

bool on_device(const at::Tensor& t) {
  return t.defined() && t.device().type() == kDev;
}

// ---------------------------------------------------------------------------
// What an operator's schema says, looked up once per operator and thread.

struct Facts {
  bool on_host = false;  // run by the host after its streams: random, or results the host reads
  bool no_returns = false;
  std::vector<int> returns_arg;  // per return: the argument it is (an in-place or out= op), or -1
  std::vector<int> view_of;  // per return: the argument it is a view of (no kernel for it), or -1
  const char* name = "";  // interned: queued tasks outlive the thread that made them
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

const Facts& facts_of(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, Facts> known;
  const auto& schema = op.schema();
  auto it = known.find(&schema);
  if (it != known.end()) {
    return it->second;
  }
  Facts f;
  f.name = intern(schema.operator_name().name);
  const auto& args = schema.arguments();
  const auto& rets = schema.returns();
  f.no_returns = rets.empty();
  f.on_host = op.hasTag(at::Tag::nondeterministic_seeded);
  for (const auto& a : args) {
    const auto& type = a.type();
    if (type->kind() == c10::TypeKind::GeneratorType ||
        (type->kind() == c10::TypeKind::OptionalType &&
         type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType)) {
      f.on_host = true;
    }
  }
  for (const auto& r : rets) {
    int arg = -1;
    if (r.alias_info() != nullptr) {
      for (size_t i = 0; i < args.size(); ++i) {
        const auto* info = args[i].alias_info();
        if (info != nullptr && info->beforeSets() == r.alias_info()->beforeSets()) {
          arg = static_cast<int>(i);
        }
      }
    }
    const bool view = r.alias_info() != nullptr && !r.alias_info()->isWrite();
    f.returns_arg.push_back(view ? -1 : arg);
    f.view_of.push_back(view ? arg : -1);
    const auto kind = r.type()->kind();
    c10::TypeKind element = kind;
    if (kind == c10::TypeKind::ListType) {
      element = r.type()->castRaw<c10::ListType>()->getElementType()->kind();
    } else if (kind == c10::TypeKind::OptionalType) {
      element = r.type()->castRaw<c10::OptionalType>()->getElementType()->kind();
    }
    const bool tensor = element == c10::TypeKind::TensorType;
    if (!tensor) {
      f.on_host = true;  // a number or a flag the host reads: it waits for it
    }
  }
  return known.emplace(&schema, std::move(f)).first->second;
}

// ---------------------------------------------------------------------------
// Running an operator.

struct Scan {
  std::array<bool, kMaxDevices> devices{};
  c10::DeviceIndex home = -1;
  int count = 0;  // devices touched
};

void touch(Scan& scan, c10::DeviceIndex index) {
  if (!scan.devices[static_cast<size_t>(index)]) {
    scan.devices[static_cast<size_t>(index)] = true;
    scan.count += 1;
  }
  if (scan.home < 0) {
    scan.home = index;
  }
}

// Refuses tensors on the device and on the host in one kernel, with torch's words, as a
// GPU kernel refuses them. A 0-dim CPU tensor passes (torch takes it as a scalar), and so
// do CPU tensors in optional-tensor lists (index's indices may stay on the host).
Scan scan_arguments(const c10::FunctionSchema& schema, const Stack& stack, size_t first) {
  Scan scan;
  std::optional<c10::Device> device, host;
  std::string host_arg;
  for (size_t i = first; i < stack.size(); ++i) {
    const c10::IValue& arg = stack[i];
    const std::string& name = schema.arguments()[i - first].name();
    auto note = [&](const at::Tensor& t) {
      if (!t.defined()) {
        return;
      }
      if (t.device().type() == kDev) {
        touch(scan, t.device().index());
        device = device.has_value() ? device : t.device();
      } else if (t.dim() > 0 && !host.has_value()) {
        host = t.device();
        host_arg = name;
      }
    };
    if (arg.isTensor()) {
      note(arg.toTensor());
    } else if (arg.isTensorList()) {
      for (const at::Tensor& t : arg.toTensorList()) {
        note(t);
      }
    } else if (arg.isList()) {
      each_tensor(arg, [&](const at::Tensor& t) {
        if (t.device().type() == kDev) {
          touch(scan, t.device().index());
        }
      });
    } else if (arg.isDevice() && arg.toDevice().type() == kDev) {
      touch(scan, arg.toDevice().has_index() ? arg.toDevice().index() : t_device);
    }
  }
  TORCH_CHECK(!device.has_value() || !host.has_value(),
              "Expected all tensors to be on the same device, but found at least two devices, ",
              device.value_or(c10::Device(kDev, 0)), " and ",
              host.value_or(c10::Device(c10::kCPU)), "! (argument '", host_arg, "' of ",
              schema.operator_name(), " is on the host; anydevice's simulated accelerator)");
  if (scan.home < 0) {
    scan.home = t_device;
    touch(scan, t_device);
  }
  return scan;
}

// The arguments for the CPU kernel: device tensors as host views (shared per storage),
// host tensors copied (the kernel may run later; a GPU copies such scalars at launch),
// devices as the CPU.
Stack host_arguments(const Stack& stack, size_t first, bool copy_host) {
  std::unordered_map<const c10::StorageImpl*, c10::Storage> shared;
  auto convert = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined()) {
      return t;
    }
    if (t.device().type() == kDev) {
      return host_view(t.storage(), t, &shared[t.storage().unsafeGetStorageImpl()]);
    }
    return copy_host ? t.clone() : t;
  };
  Stack out;
  out.reserve(stack.size() - first);
  for (size_t i = first; i < stack.size(); ++i) {
    const c10::IValue& arg = stack[i];
    if (arg.isDevice() && arg.toDevice().type() == kDev) {
      out.emplace_back(c10::Device(c10::DeviceType::CPU));
    } else {
      out.push_back(map_tensors(arg, convert));
    }
  }
  return out;
}

// A key for the arguments' shapes, dtypes and values (not their data): what the meta
// kernel's answer depends on. False for arguments it cannot say (symbolic sizes, objects).
bool shape_key(const c10::IValue& v, std::string& key) {
  auto add = [&](const auto& x) { key.append(reinterpret_cast<const char*>(&x), sizeof(x)); };
  auto tensor = [&](const at::Tensor& t) {
    add('T');
    if (!t.defined()) {
      add('u');
      return true;
    }
    if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      return false;
    }
    add(static_cast<int8_t>(t.scalar_type()));
    add(static_cast<int8_t>(t.device().type()));
    add(t.device().index());
    add(t.unsafeGetTensorImpl()->is_wrapped_number());
    add(static_cast<int64_t>(t.dim()));
    for (int64_t d : t.sizes()) add(d);
    for (int64_t d : t.strides()) add(d);
    add(t.storage_offset());
    add(static_cast<int64_t>(t.storage().nbytes()));
    return true;
  };
  if (v.isNone()) {
    add('N');
  } else if (v.isTensor()) {
    return tensor(v.toTensor());
  } else if (v.isInt()) {
    add('i');
    add(v.toInt());
  } else if (v.isDouble()) {
    add('d');
    add(v.toDouble());
  } else if (v.isBool()) {
    add('b');
    add(v.toBool());
  } else if (v.isComplexDouble()) {
    add('c');
    add(v.toComplexDouble());
  } else if (v.isString()) {
    add('s');
    key += v.toStringRef();
    add('\0');
  } else if (v.isDevice()) {
    add('D');
    add(static_cast<int8_t>(v.toDevice().type()));
    add(v.toDevice().index());
  } else if (v.isIntList()) {
    add('I');
    for (int64_t x : v.toIntList()) add(x);
    add('e');
  } else if (v.isList()) {
    add('L');
    for (const c10::IValue& item : v.toList()) {
      if (!shape_key(item, key)) {
        return false;
      }
    }
    add('e');
  } else {
    return false;  // symbolic numbers, generators, objects: not cached
  }
  return true;
}

// The outputs' shapes from torch's meta kernel; throws where there is none (or the
// shape depends on the data).
Stack meta_outputs(const c10::OperatorHandle& op, const Stack& stack, size_t first) {
  std::unordered_map<const c10::StorageImpl*, c10::Storage> shared;
  auto convert = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.device().type() != kDev) {
      return t;
    }
    return meta_view(t, &shared[t.storage().unsafeGetStorageImpl()]);
  };
  Stack meta;
  for (size_t i = first; i < stack.size(); ++i) {
    const c10::IValue& arg = stack[i];
    if (arg.isDevice() && arg.toDevice().type() == kDev) {
      meta.emplace_back(c10::Device(c10::DeviceType::Meta));
    } else {
      meta.push_back(map_tensors(arg, convert));
    }
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  op.callBoxed(&meta);
  return meta;
}

// meta_outputs, remembered per operator and shapes: torch's meta kernels for the common
// operators are Python (they match torch.compile's), far slower than the CPU kernel;
// a training loop repeats its shapes.
const Stack& meta_cached(const c10::OperatorHandle& op, const Stack& stack, size_t first) {
  thread_local std::unordered_map<std::string, Stack> known;
  thread_local Stack scratch;
  std::string key(reinterpret_cast<const char*>(&op.schema()), sizeof(void*));
  bool cacheable = true;
  for (size_t i = first; i < stack.size() && cacheable; ++i) {
    cacheable = shape_key(stack[i], key);
  }
  if (cacheable) {
    auto it = known.find(key);
    if (it != known.end()) {
      return it->second;
    }
  }
  Stack meta = meta_outputs(op, stack, first);
  if (!cacheable) {
    scratch = std::move(meta);
    return scratch;
  }
  if (known.size() > 4096) {
    known.clear();
  }
  return known.emplace(std::move(key), std::move(meta)).first->second;
}

// Runs `op` on the host now, after the streams it touches: for operators whose results
// the host reads, random ones, and those without a meta kernel.
void run_now(const c10::OperatorHandle& op, Stack* stack, size_t first, const Scan& scan) {
  for (int d = 0; d < kMaxDevices; ++d) {
    if (scan.devices[static_cast<size_t>(d)]) {
      current_stream(static_cast<c10::DeviceIndex>(d)).synchronize();
    }
  }
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  Stack args(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  Stack host = host_arguments(*stack, first, /*copy_host=*/false);
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &host);
  }
  torch::jit::drop(*stack, nargs);
  // Results: the arguments they alias, or fresh device tensors the results are copied
  // into on the stream (after the poison the allocation queued there).
  const Facts& facts = facts_of(op);
  const c10::Device home(kDev, scan.home);
  Stream& stream = current_stream(scan.home);
  auto back = [&](const at::Tensor& t, size_t i) -> at::Tensor {
    if (!t.defined() || !t.is_cpu()) {
      return t;
    }
    const int arg = facts.returns_arg[i];
    if (arg >= 0 && args[static_cast<size_t>(arg)].isTensor()) {
      return args[static_cast<size_t>(arg)].toTensor();
    }
    for (const c10::IValue& a : args) {
      if (a.isTensor() && on_device(a.toTensor()) &&
          a.toTensor().storage().data() == t.storage().data() && t.storage().data() != nullptr) {
        return device_view(a.toTensor(), t);  // a view of an argument
      }
    }
    at::Tensor out = empty_on(home, t.sizes(), t.strides(), t.scalar_type());
    c10::Storage shared;
    at::Tensor view = host_view(out.storage(), out, &shared);
    at::Tensor result = t;
    stream.enqueue([view, result]() mutable { view.copy_(result); }, "a result's copy");
    return out;
  };
  for (size_t i = 0; i < host.size(); ++i) {
    const c10::IValue& r = host[i];
    if (r.isTensor()) {
      stack->emplace_back(back(r.toTensor(), i));
    } else if (r.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : r.toTensorList()) {
        list.push_back(back(t, i));
      }
      stack->emplace_back(list);
    } else {
      stack->push_back(r);
    }
  }
}

// Copies a CPU kernel's result into the output the meta kernel shaped. A few CPU kernels
// return an empty tensor where the meta kernel shapes one that is not used (batch norm's
// saved statistics in eval mode): it keeps its poison.
void put(const at::Tensor& result, at::Tensor& out) {
  if (result.sizes() == out.sizes()) {
    out.copy_(result);
  } else if (result.numel() == out.numel()) {
    out.copy_(result.reshape(out.sizes()));
  } else {
    TORCH_CHECK(result.numel() == 0, "the CPU kernel's output has shape ", result.sizes(),
                ", its meta kernel said ", out.sizes());
  }
}

// torch's at::native::resize_output, whose header takes 1.5 s of the build to read: an out=
// argument of another shape is resized, with torch's warning when it held elements.
void resize_output(const at::Tensor& out, c10::IntArrayRef shape) {
  if (out.numel() != 0) {
    TORCH_WARN("An output with one or more elements was resized since it had shape ",
               out.sizes(), ", which does not match the required output shape ", shape,
               ". This behavior is deprecated, and in a future PyTorch release outputs will "
               "not be resized unless they have zero elements. You can explicitly reuse an "
               "out tensor t by resizing it, inplace, to zero elements with t.resize_(0).");
  }
  out.resize_(shape);
}

// The asynchronous path: outputs from the meta kernel, the CPU kernel queued.
void launch(const c10::OperatorHandle& op, Stack* stack, size_t first, const Scan& scan,
            const Facts& facts, const Stack& meta) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const c10::Device home(kDev, scan.home);
  Stack args(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());

  // out= arguments take the outputs' shapes first.
  for (size_t i = 0; i < meta.size(); ++i) {
    const int arg = facts.returns_arg[i];
    if (arg >= 0 && meta[i].isTensor() && args[static_cast<size_t>(arg)].isTensor()) {
      const at::Tensor& out = args[static_cast<size_t>(arg)].toTensor();
      const at::Tensor& shape = meta[i].toTensor();
      if (on_device(out) && out.sizes() != shape.sizes()) {
        resize_output(out, shape.sizes());
      }
    }
  }

  // Returns, and the host views the kernel's fresh results are copied into.
  Stack returns;
  struct Poison {
    void* data;
    size_t bytes;
    int value;
  };
  std::vector<Poison> poisons;  // fresh outputs' bytes, poisoned by the task
  std::vector<std::pair<size_t, at::Tensor>> fresh;  // (return, its host view)
  std::vector<std::pair<size_t, std::vector<at::Tensor>>> fresh_lists;
  auto make = [&](const at::Tensor& shape, size_t i) -> at::Tensor {
    if (!shape.defined()) {
      return shape;
    }
    const int arg = facts.returns_arg[i];
    if (arg >= 0 && args[static_cast<size_t>(arg)].isTensor()) {
      return args[static_cast<size_t>(arg)].toTensor();
    }
    const int base = facts.view_of[i];
    if (base >= 0) {
      at::Tensor view;
      each_tensor(args[static_cast<size_t>(base)], [&](const at::Tensor& t) {
        if (!view.defined() && on_device(t)) {
          view = device_view(t, shape);  // a view of it, or of a list's element (split)
        }
      });
      if (view.defined()) {
        return view;
      }
    }
    const c10::DeviceGuard guard(home);
    t_unpoisoned = true;  // the kernel's task poisons it, before it runs
    at::Tensor out;
    try {
      out = empty_on(home, shape.sizes(), shape.strides(), shape.scalar_type());
    } catch (...) {
      t_unpoisoned = false;
      throw;
    }
    t_unpoisoned = false;
    if (out.storage().nbytes() > 0) {  // 0xFF is no valid bool: bool tensors start true
      poisons.push_back({out.storage().mutable_data(), out.storage().nbytes(),
                         out.scalar_type() == at::kBool ? 0x01 : 0xFF});
    }
    return out;
  };
  bool kernel = facts.no_returns;  // a void operator writes its arguments
  for (size_t i = 0; i < meta.size(); ++i) {
    const c10::IValue& r = meta[i];
    const bool is_fresh = facts.returns_arg[i] < 0 && facts.view_of[i] < 0;
    kernel = kernel || facts.view_of[i] < 0;
    if (r.isTensor()) {
      at::Tensor out = make(r.toTensor(), i);
      if (is_fresh && out.defined()) {
        c10::Storage shared;
        fresh.emplace_back(i, host_view(out.storage(), out, &shared));
      }
      returns.emplace_back(out);
    } else if (r.isTensorList()) {
      c10::List<at::Tensor> list;
      std::vector<at::Tensor> views;
      for (const at::Tensor& t : r.toTensorList()) {
        at::Tensor out = make(t, i);
        if (is_fresh) {
          c10::Storage shared;
          views.push_back(host_view(out.storage(), out, &shared));
        }
        list.push_back(out);
      }
      if (is_fresh) {
        fresh_lists.emplace_back(i, std::move(views));
      }
      returns.emplace_back(list);
    } else {
      returns.push_back(r);
    }
  }

  if (kernel) {
    Stack host = host_arguments(*stack, first, /*copy_host=*/true);
    auto task = [op, host, fresh, fresh_lists, poisons]() mutable {
      for (const auto& p : poisons) {
        std::memset(p.data, p.value, p.bytes);
      }
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &host);
      for (auto& [i, view] : fresh) {
        put(host[i].toTensor(), view);
      }
      for (auto& [i, views] : fresh_lists) {
        const auto results = host[i].toTensorList();
        TORCH_CHECK(results.size() == views.size(), "the CPU kernel returned ", results.size(),
                    " tensors, its meta kernel ", views.size());
        for (size_t k = 0; k < views.size(); ++k) {
          put(results.get(k), views[k]);
        }
      }
    };
    current_stream(scan.home).enqueue(std::move(task), facts.name);
  }
  torch::jit::drop(*stack, nargs);
  for (auto& r : returns) {
    stack->push_back(std::move(r));
  }
}

void run_on_device(const c10::OperatorHandle& op, Stack* stack) {
  const auto& schema = op.schema();
  const size_t first = stack->size() - schema.arguments().size();
  const Scan scan = scan_arguments(schema, *stack, first);
  const Facts& facts = facts_of(op);
  // The failure of a kernel queued before is reported now, as a GPU reports it at the
  // next launch.
  current_stream(scan.home).raise_failure();
  if (facts.on_host || scan.count > 1) {
    run_now(op, stack, first, scan);
    return;
  }
  static const Stack none;
  const Stack* meta = &none;
  if (!facts.no_returns) {
    try {
      meta = &meta_cached(op, *stack, first);
    } catch (const std::exception& e) {
      if (std::getenv("ANYDEVICE_SIM_DEBUG") != nullptr) {
        fprintf(stderr, "anydevice simulator: no meta for %s: %s\n", facts.name, e.what());
      }
      // No meta kernel, or an output shape that depends on the data (nonzero): the host
      // waits and runs it. A wrong argument raises again from the CPU kernel, in its words.
      run_now(op, stack, first, scan);
      return;
    }
  }
  launch(op, stack, first, scan, facts, *meta);
}

// Convolutions: torch sends a backend other than the CPU and CUDA to the "overrideable"
// ops, which have no CPU kernel. Their arguments are those of the generic ops (the
// backward lacks bias_sizes, which may be None), so the device runs the generic ones.
void convolution_on_device(const c10::OperatorHandle& /*op*/, Stack* stack) {
  static const auto target = c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  run_on_device(target, stack);
}

void convolution_backward_on_device(const c10::OperatorHandle& op, Stack* stack) {
  static const auto target =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution_backward", "");
  const size_t first = stack->size() - op.schema().arguments().size();
  // (grad_output, input, weight, [bias_sizes], stride, padding, ...)
  stack->insert(stack->begin() + static_cast<std::ptrdiff_t>(first + 3), c10::IValue());
  run_on_device(target, stack);
}

// ---------------------------------------------------------------------------
// Allocation, views, resizing.

void poison_bool(const at::Tensor& t) {
  // 0xFF is no valid bool: bool tensors start true instead (still not what was written).
  if (t.scalar_type() == at::kBool && t.storage().nbytes() > 0) {
    void* data = t.storage().mutable_data();
    const size_t n = t.storage().nbytes();
    current_stream(t.device().index()).enqueue([data, n] { std::memset(data, 0x01, n); }, "poison");
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
  at::Tensor t = at::detail::empty_generic(size, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
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
      size, stride, device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
  poison_bool(t);
  return t;
}

// Grows the storage when needed: a new block, and the old bytes copied over on the
// current stream, after the work queued there that may still write them.
const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  const int64_t numel = impl->numel();
  if (numel > 0) {
    const size_t needed = (impl->storage_offset() + numel) * self.dtype().itemsize();
    const c10::Storage& storage = impl->unsafe_storage();
    if (needed > storage.nbytes()) {
      const auto device = self.device().index();
      auto fresh = allocate(device, needed);
      const size_t old = storage.nbytes();
      if (old > 0) {
        void* from = storage.mutable_data();
        void* to = fresh.get();
        // The old block may belong to another stream: it is kept for this one's copy.
        device_allocator()->recordStream(storage.data_ptr(), make_stream(device, t_stream[static_cast<size_t>(device)]));
        current_stream(device).enqueue([to, from, old] { std::memcpy(to, from, old); }, "resize_");
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

void record_stream(const at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == kDev,
              "record_stream: the stream is on ", stream.device(), ", the tensor on ",
              self.device(), "; give it a stream of the tensor's device");
  device_allocator()->recordStream(self.storage().data_ptr(), stream);
}

// ---------------------------------------------------------------------------
// Copies. The rules are CUDA's:
// - host -> device and device -> host go on the current stream of the device's side and
//   take the link's time. With non_blocking=True and a pinned host buffer the host does
//   not wait. A pageable source with non_blocking=True: the host waits for the stream's
//   earlier work, stages the bytes, and does not wait for the copy (CUDA's driver does
//   that); a pageable destination, or a blocking copy: the host waits for the copy.
// - device -> device goes on the destination's current stream and never makes the host
//   wait, whatever non_blocking says. Across devices the source's stream is waited for
//   first, and the source's current stream waits for the copy: later work there (a kernel
//   that writes the source) comes after the copy has read it, as CUDA's copy orders it.
at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  const bool from_device = src.device().type() == kDev;
  const bool to_device = dst.device().type() == kDev;
  if (from_device && to_device) {
    const auto device = dst.device().index();
    const auto source = src.device().index();
    if (source != device) {
      current_stream(source).synchronize();
    }
    c10::Storage a, b;
    at::Tensor from = host_view(src.storage(), src, &a);
    at::Tensor to = src.storage().unsafeGetStorageImpl() == dst.storage().unsafeGetStorageImpl()
                        ? host_view(dst.storage(), dst, &a)
                        : host_view(dst.storage(), dst, &b);
    Stream& target = current_stream(device);
    const int64_t ticket = target.enqueue(
        [from, to]() mutable {
          at::AutoDispatchBelowADInplaceOrView below_autograd;
          to.copy_(from);
        },
        "a device-to-device copy");
    if (source != device) {
      current_stream(source).enqueue([&target, ticket] { target.reached(ticket); },
                                     "a wait for a copy to another device");
    }
    return dst;
  }
  TORCH_CHECK(from_device || to_device, "anydevice simulator: a copy with no device side");
  const at::Tensor& host = from_device ? dst : src;
  const at::Tensor& dev = from_device ? src : dst;
  TORCH_CHECK(host.is_cpu(), "anydevice simulator: copies go to and from the CPU, not ",
              host.device());
  const auto device = dev.device().index();
  const size_t bytes = static_cast<size_t>(src.numel()) * src.element_size();
  const c10::StreamId stream_id = t_stream[static_cast<size_t>(device)];
  Stream& stream = stream_of(device, stream_id);
  const bool pinned = is_pinned(host);
  // The task holds the host memory (torch's pinned allocator waits for the copy too),
  // through a tensor Python never saw: the worker that drops it needs no GIL. It copies
  // through pinned memory's second mapping, which stays open while the host's is
  // protected (pinned.cpp).
  at::Tensor owner = same_bytes(host);
  at::Tensor held = owner;
  if (pinned) {
    const c10::Storage storage = host.storage();
    c10::Storage through(c10::Storage::use_byte_size_t(), storage.nbytes(),
                         c10::DataPtr(pinned_alias(storage.data()), c10::Device(c10::DeviceType::CPU)),
                         nullptr, /*resizable=*/false);
    held = host_view(through, host, &through);
  }
  if (to_device && non_blocking && !pinned) {
    stream.synchronize();  // CUDA's driver waits for the stream before staging pageable bytes
    held = host.clone();  // the staging buffer: the caller may change src once this returns
    owner = held;
  }
  c10::Storage shared;
  at::Tensor view = host_view(dev.storage(), dev, &shared);
  const int64_t ticket = stream.enqueue(
      [owner, held, view, device, to_device, bytes, stream_id]() mutable {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        cross_link(device, to_device, bytes, stream_id);
        // The bytes land at the end of the transfer: a reader that did not wait sees the
        // poison, or the values from before.
        if (to_device) {
          view.copy_(held);
        } else {
          held.copy_(view);
        }
      },
      to_device ? "a host-to-device copy" : "a device-to-host copy");
  if (!non_blocking || (!to_device && !pinned)) {
    stream.wait(ticket);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst) {
  if (dst.device().type() == kDev) {
    resize_(dst, src.sizes(), std::nullopt);
  } else {
    dst.resize_(src.sizes());
  }
  return copy_from(src, dst, false);
}

// ---------------------------------------------------------------------------
// The entry points torch calls (boxed: see boxed.h), each reading its schema's arguments.

using boxed::args;
using boxed::done;
using boxed::ints;
using boxed::Stack;

void empty_memory_format_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // size, *, dtype, layout, device, pin_memory, memory_format
  at::Tensor out = empty_memory_format(ints(a[0]), boxed::dtype(a[1]), boxed::layout(a[2]),
                                       boxed::device(a[3]), boxed::flag(a[4]),
                                       boxed::memory_format(a[5]));
  done(op, stack, std::move(out));
}

void empty_strided_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // size, stride, *, dtype, layout, device, pin_memory
  at::Tensor out = empty_strided(ints(a[0]), ints(a[1]), boxed::dtype(a[2]), boxed::layout(a[3]),
                                 boxed::device(a[4]), boxed::flag(a[5]));
  done(op, stack, std::move(out));
}

void as_strided_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, size, stride, storage_offset?
  const std::optional<int64_t> offset =
      a[3].isNone() ? std::nullopt : std::make_optional(a[3].toSymInt().expect_int());
  at::Tensor out =
      at::native::as_strided_tensorimpl(a[0].toTensor(), ints(a[1]), ints(a[2]), offset);
  done(op, stack, std::move(out));
}

void view_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, size
  at::Tensor out = at::native::view(a[0].toTensor(), ints(a[1]));
  done(op, stack, std::move(out));
}

void reshape_alias_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, size, stride
  at::Tensor out = at::native::_reshape_alias(a[0].toTensor(), ints(a[1]), ints(a[2]));
  done(op, stack, std::move(out));
}

void resize_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, size, *, memory_format
  at::Tensor self = a[0].toTensor();
  resize_(self, ints(a[1]), boxed::memory_format(a[2]));
  done(op, stack, std::move(self));
}

void copy_from_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, dst, non_blocking
  at::Tensor out = copy_from(a[0].toTensor(), a[1].toTensor(), a[2].toBool());
  done(op, stack, std::move(out));
}

void copy_from_and_resize_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, dst
  at::Tensor out = copy_from_and_resize(a[0].toTensor(), a[1].toTensor());
  done(op, stack, std::move(out));
}

void set_tensor_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, source
  at::Tensor self = a[0].toTensor();
  at::native::set_tensor_(self, a[1].toTensor());
  done(op, stack, std::move(self));
}

void set_storage_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, source
  at::Tensor self = a[0].toTensor();
  at::native::set_(self, a[1].toStorage());
  done(op, stack, std::move(self));
}

void set_storage_offset_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, source, storage_offset, size, stride
  at::Tensor self = a[0].toTensor();
  at::native::set_storage_cpu_(self, a[1].toStorage(), a[2].toSymInt().expect_int(),
                               ints(a[3]), ints(a[4]));
  done(op, stack, std::move(self));
}

void record_stream_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const auto a = args(op, stack);  // self, s
  record_stream(a[0].toTensor(), a[1].toStream());
  done(op, stack);
}

}  // namespace

void register_kernels() {
  static bool done = false;
  if (done) {
    return;
  }
  done = true;
  // Made at run time (not at load), so that loading this library registers nothing: its
  // race detector serves other accelerators too.
  auto* aten = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                  __FILE__, __LINE__);
  aten->impl("convolution_overrideable",
             torch::CppFunction::makeFromBoxedFunction<&convolution_on_device>());
  aten->impl("convolution_backward_overrideable",
             torch::CppFunction::makeFromBoxedFunction<&convolution_backward_on_device>());
  // These two have a composite kernel for other backends that hands their out= kernel a
  // 0-dim output, which torch's CPU kernel resizes with a deprecation warning: the
  // device runs the CPU's own kernel for the whole op instead.
  aten->impl("mse_loss", torch::CppFunction::makeFromBoxedFunction<&run_on_device>());
  aten->impl("smooth_l1_loss", torch::CppFunction::makeFromBoxedFunction<&run_on_device>());
  aten->impl("empty.memory_format", boxed::entry<&empty_memory_format_boxed>());
  aten->impl("empty_strided", boxed::entry<&empty_strided_boxed>());
  aten->impl("as_strided", boxed::entry<&as_strided_boxed>());
  aten->impl("view", boxed::entry<&view_boxed>());
  aten->impl("_reshape_alias", boxed::entry<&reshape_alias_boxed>());
  aten->impl("resize_", boxed::entry<&resize_boxed>());
  aten->impl("_copy_from", boxed::entry<&copy_from_boxed>());
  aten->impl("_copy_from_and_resize", boxed::entry<&copy_from_and_resize_boxed>());
  aten->impl("set_.source_Tensor", boxed::entry<&set_tensor_boxed>());
  aten->impl("set_.source_Storage", boxed::entry<&set_storage_boxed>());
  aten->impl("set_.source_Storage_storage_offset", boxed::entry<&set_storage_offset_boxed>());
  aten->impl("record_stream", boxed::entry<&record_stream_boxed>());
  register_recurrent_cells(*aten);  // nn.LSTM and nn.GRU: kernels CUDA has and the CPU lacks
  // torch.autocast on this device runs, and casts nothing: ops keep their dtypes (the
  // simulator models no reduced-precision units).
  auto* autocast = new torch::Library(torch::Library::IMPL, "_",
                                      c10::DispatchKey::AutocastPrivateUse1, __FILE__, __LINE__);
  autocast->fallback(torch::CppFunction::makeFallthrough());
  auto* rest = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1,
                                  __FILE__, __LINE__);
  rest->fallback(torch::CppFunction::makeFromBoxedFunction<&run_on_device>());
}

}  // namespace anydevice_sim
