// What fusionlab's C++ op files share around their kernels: typed handles of ops found by name,
// the body of an Autograd kernel (a plain redispatch below autograd, or the autograd Function that
// records the backward), and the registration of an op's schema with its kernels.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fusionlab_cpu {

// What the ops' autograd Functions take and return.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// An op's name (or overload name) as a template argument.
template <std::size_t N>
struct OpName {
  constexpr OpName(const char (&text)[N]) { std::copy_n(text, N, chars); }  // NOLINT: implicit
  char chars[N];
};

// The typed handle of op kName (e.g. "fusionlab::rms_norm_cpu") and its overload kOverload, found
// in the dispatcher on first use and kept: op_handle<Signature, "fusionlab::x">().call(...).
template <typename Signature, OpName kName, OpName kOverload = "">
const c10::TypedOperatorHandle<Signature>& op_handle() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow(kName.chars, kOverload.chars)
                                 .template typed<Signature>();
  return handle;
}

// An argument as an autograd Function keeps it: a string view becomes the string it views.
template <typename A>
decltype(auto) kept(const A& arg) {
  if constexpr (std::is_same_v<A, c10::string_view>) {
    return std::string(arg);
  } else {
    return arg;
  }
}

template <typename Result, std::size_t... I>
Result tuple_of(const torch::autograd::variable_list& outputs, std::index_sequence<I...>) {
  return Result{outputs[I]...};
}

// An autograd Function's outputs as the op returns them: its one tensor, or a tuple of its list.
template <typename Result, typename Outputs>
Result as_result(const Outputs& outputs) {
  if constexpr (std::is_same_v<Outputs, Result>) {
    return outputs;
  } else {
    return tuple_of<Result>(outputs, std::make_index_sequence<std::tuple_size_v<Result>>{});
  }
}

// The body of an Autograd kernel: `op` below autograd when `record` is false (no input needs a
// gradient: no Python, no graph node), else Fn::apply, the Function whose backward is recorded.
// Fn::forward takes `args` (string views as strings), then the dispatch keys below autograd.
template <typename Fn, typename Signature, typename... Args>
auto redispatch_or_record(c10::DispatchKeySet keys, const c10::TypedOperatorHandle<Signature>& op,
                          bool record, const Args&... args) {
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  using Result = decltype(op.redispatch(below, args...));
  if (!record) {
    return op.redispatch(below, args...);
  }
  return as_result<Result>(Fn::apply(kept(args)..., below));
}

// The name of the op a schema declares: what precedes its argument list.
inline std::string schema_name(const char* schema) {
  const std::string text(schema);
  return text.substr(0, text.find('('));
}

// Declares op `schema` with `cpu` as its CPU kernel.
template <typename Cpu>
void def_cpu(torch::Library& m, const char* schema, Cpu&& cpu) {
  m.def(schema);
  m.impl(schema_name(schema).c_str(),
         torch::dispatch(c10::DispatchKey::CPU, std::forward<Cpu>(cpu)));
}

// Registers `autograd` as op `name`'s Autograd kernel.
template <typename Autograd>
void impl_autograd(torch::Library& m, const char* name, Autograd&& autograd) {
  m.impl(name, torch::dispatch(c10::DispatchKey::Autograd, std::forward<Autograd>(autograd)));
}

// Declares op `schema` with its CPU and Autograd kernels.
template <typename Cpu, typename Autograd>
void def_cpu_autograd(torch::Library& m, const char* schema, Cpu&& cpu, Autograd&& autograd) {
  def_cpu(m, schema, std::forward<Cpu>(cpu));
  impl_autograd(m, schema_name(schema).c_str(), std::forward<Autograd>(autograd));
}

}  // namespace fusionlab_cpu
