// Runtime flags as compile-time ones: with_flags(body, a, b, ...) calls body with one
// std::bool_constant per flag, in order, so that each combination runs its own instantiation of a
// kernel template (no branch on a flag in its hot loops).
#pragma once

#include <type_traits>

namespace fusionlab_cpu {

template <typename Body>
decltype(auto) with_flags(const Body& body) {
  return body();
}

template <typename Body, typename... Flags>
decltype(auto) with_flags(const Body& body, bool flag, Flags... rest) {
  if (flag) {
    return with_flags([&](auto... known) { return body(std::true_type{}, known...); }, rest...);
  }
  return with_flags([&](auto... known) { return body(std::false_type{}, known...); }, rest...);
}

}  // namespace fusionlab_cpu
