// Reading a boxed call's arguments: the simulator's kernels are registered boxed (a stack
// of IValues in, results pushed back), not as typed C++ functions. A typed registration
// makes the compiler instantiate torch's boxing and schema templates once per signature:
// for 16 kernels that was 5 s of the first build's CPU (a quarter of sim_operators.cpp).
// Every other operator on the device already goes through the boxed fallback, so a boxed
// call here costs nothing that shows.
//
// Each entry point reads its arguments with these helpers, calls the typed kernel, drops
// the arguments and pushes the results. The number of arguments comes from the operator's
// schema, so an argument torch adds at the end is dropped with the rest.

#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace anydevice_sim::boxed {

using Stack = torch::jit::Stack;

// The kernel to register: torch::Library::impl(name, entry<&kernel>()).
template <c10::BoxedKernel::BoxedKernelFunction* kernel>
torch::CppFunction entry() {
  return torch::CppFunction::makeFromBoxedFunction<kernel>();
}

// The call's arguments, first to last, left on the stack until done().
inline c10::ArrayRef<c10::IValue> args(const c10::OperatorHandle& op, const Stack* stack) {
  return torch::jit::last(stack, op.schema().arguments().size());
}

// Drops the arguments and pushes the results.
template <class... Results>
void done(const c10::OperatorHandle& op, Stack* stack, Results&&... results) {
  torch::jit::drop(stack, op.schema().arguments().size());
  torch::jit::push(stack, std::forward<Results>(results)...);
}

// A SymInt[] of concrete sizes (the simulator runs no symbolic shapes).
inline std::vector<int64_t> ints(const c10::IValue& v) {
  if (v.isIntList()) {
    return v.toIntVector();
  }
  std::vector<int64_t> out;
  for (const auto& s : v.toSymIntVector()) {
    out.push_back(s.expect_int());
  }
  return out;
}

inline std::optional<c10::ScalarType> dtype(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::make_optional(v.toScalarType());
}

inline std::optional<c10::Layout> layout(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::make_optional(v.toLayout());
}

inline std::optional<c10::Device> device(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::make_optional(v.toDevice());
}

inline std::optional<bool> flag(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::make_optional(v.toBool());
}

inline std::optional<c10::MemoryFormat> memory_format(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::make_optional(v.toMemoryFormat());
}

inline std::optional<at::Tensor> tensor(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::make_optional(v.toTensor());
}

}  // namespace anydevice_sim::boxed
