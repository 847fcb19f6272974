// The inputs and outputs of fusionlab's CPU norm ops: the argument checks, one for every forward
// (rmsnorm, layernorm and their fused residual adds) and one for every plain backward (x, for the
// add ops a residual of x's shape and dtype, a weight and for layernorm a bias, both 1-D of size
// x.size(-1)), x's rows at one stride, and outputs allocated without the dispatcher.
#pragma once

#include "cpu_norm_common.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fusionlab_cpu {

// The tensors of a call; residual and bias are null where the op has none.
struct NormTensors {
  const at::Tensor& x;
  const at::Tensor* residual;
  const at::Tensor& weight;
  const at::Tensor* bias;
};

// "a", "a and b", "a, b and c".
inline std::string listed(const std::vector<std::string>& items) {
  std::string text;
  for (std::size_t i = 0; i < items.size(); ++i) {
    text += (i == 0 ? "" : (i + 1 == items.size() ? " and " : ", ")) + items[i];
  }
  return text;
}

// The parameters' names ("weight", "weight and bias") and what `describe` says of each.
template <typename Describe>
std::string of_params(const NormTensors& t, const Describe& describe) {
  std::vector<std::string> items{describe("weight", t.weight)};
  if (t.bias != nullptr) {
    items.push_back(describe("bias", *t.bias));
  }
  return listed(items);
}

inline bool params_fit(const NormTensors& t) {
  const int64_t hidden = t.x.size(-1);
  const auto fits = [&](const at::Tensor& p) { return p.dim() == 1 && p.size(0) == hidden; };
  return fits(t.weight) && (t.bias == nullptr || fits(*t.bias));
}

inline bool dtypes_supported(const NormTensors& t) {
  return is_supported_dtype(t.x.scalar_type()) && is_supported_dtype(t.weight.scalar_type()) &&
         (t.bias == nullptr || is_supported_dtype(t.bias->scalar_type()));
}

inline std::string sizes_text(const at::Tensor& t) {
  return c10::str(t.sizes());
}

// The forward ops' checks, in this order: devices, x's dims, the residual's shape, the parameters'
// shapes, the dtypes, the residual's dtype, eps and rows_per_task.
inline void check_forward_args(const char* op, const NormTensors& t, double eps,
                               int64_t rows_per_task) {
  std::vector<std::string> names{"x"}, devices{t.x.device().str()};
  for (const auto& [name, tensor] : {std::pair{"residual", t.residual},
                                     std::pair{"weight", &t.weight}, std::pair{"bias", t.bias}}) {
    if (tensor != nullptr) {
      names.push_back(name);
      devices.push_back(tensor->device().str());
    }
  }
  bool on_cpu = t.x.device().is_cpu() && t.weight.device().is_cpu();
  on_cpu = on_cpu && (t.residual == nullptr || t.residual->device().is_cpu());
  TORCH_CHECK(on_cpu && (t.bias == nullptr || t.bias->device().is_cpu()), op, ": ",
              listed(names), " must be CPU tensors, got ", listed(devices));
  TORCH_CHECK(t.x.dim() >= 1, op, ": x must have at least 1 dim");
  TORCH_CHECK(t.residual == nullptr || t.residual->sizes() == t.x.sizes(), op,
              ": residual must have x's shape ", t.x.sizes(), ", got ", t.residual->sizes());
  const auto name = [](const char* param, const at::Tensor&) { return std::string(param); };
  const auto shape = [](const char*, const at::Tensor& p) { return sizes_text(p); };
  TORCH_CHECK(params_fit(t), op, ": ", of_params(t, name), " must be 1-D of size ", t.x.size(-1),
              " (x.size(-1)), got shape", t.bias == nullptr ? " " : "s ", of_params(t, shape));
  const auto dtype = [](const char* param, const at::Tensor& p) {
    return c10::str(param, " ", p.scalar_type());
  };
  TORCH_CHECK(dtypes_supported(t), op, ": dtypes must be float32, bfloat16 or float16, got x ",
              t.x.scalar_type(), t.bias == nullptr ? " and " : ", ", of_params(t, dtype));
  TORCH_CHECK(t.residual == nullptr || t.residual->scalar_type() == t.x.scalar_type(), op,
              ": residual must have x's dtype ", t.x.scalar_type(), ", got ",
              t.residual->scalar_type());
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(rows_per_task >= 1, op, ": rows_per_task must be >= 1, got ", rows_per_task);
}

// The plain (not add) backward ops' checks: grad_y has x's shape and dtype.
inline void check_backward_args(const char* op, const at::Tensor& grad_y, const NormTensors& t,
                                int64_t rows_per_task) {
  TORCH_CHECK(grad_y.device().is_cpu() && t.x.device().is_cpu() && t.weight.device().is_cpu() &&
                  (t.bias == nullptr || t.bias->device().is_cpu()),
              op, ": tensors must be on the CPU");
  TORCH_CHECK(t.x.dim() >= 1 && grad_y.sizes() == t.x.sizes(), op,
              ": grad_y must have x's shape, got ", grad_y.sizes(), " and ", t.x.sizes());
  const auto name = [](const char* param, const at::Tensor&) { return std::string(param); };
  const auto shape = [](const char*, const at::Tensor& p) { return sizes_text(p); };
  TORCH_CHECK(params_fit(t), op, ": ", of_params(t, name),
              " must be 1-D of size x.size(-1), got ", of_params(t, shape));
  const auto dtype = [](const char* param, const at::Tensor& p) {
    return c10::str(param, " ", p.scalar_type());
  };
  TORCH_CHECK(grad_y.scalar_type() == t.x.scalar_type() && dtypes_supported(t), op,
              ": x and grad_y must share one of float32, bfloat16, float16; got ",
              t.x.scalar_type(), ", ", grad_y.scalar_type(), " and ", of_params(t, dtype));
  TORCH_CHECK(rows_per_task >= 1, op, ": rows_per_task must be >= 1, got ", rows_per_task);
}

// A tensor of t's shape and dtype, allocated without the dispatcher so that a profiled call is a
// single op record.
inline at::Tensor empty_cpu_like(const at::Tensor& t) {
  return at::detail::empty_cpu(t.sizes(), t.scalar_type());
}

// Whether `out` (rows of out.size(-1)) is written with non-temporal stores (should_stream).
inline bool streams(const at::Tensor& out, StoreKind kind) {
  return should_stream(out.data_ptr(), out.size(-1), out.element_size(), out.nbytes(), kind);
}

// A 1-D parameter (weight, bias) as fp32, plus `offset` (widen_to_float), with what data() points
// into: the parameter made contiguous, or its widened copy.
class Fp32Param {
 public:
  explicit Fp32Param(const at::Tensor& param, float offset = 0.f)
      : contiguous_(param.contiguous()), data_(widen_to_float(contiguous_, widened_, offset)) {}
  Fp32Param(const Fp32Param&) = delete;
  Fp32Param& operator=(const Fp32Param&) = delete;

  const float* data() const { return data_; }

 private:
  at::Tensor contiguous_;
  std::unique_ptr<float[]> widened_;
  const float* data_;
};

// x's rows, `stride` elements apart: x itself where its layout has one stride between all rows
// (uniform_row_stride), else a contiguous copy.
struct StridedRows {
  at::Tensor tensor;
  int64_t stride;
};

inline StridedRows strided_rows(const at::Tensor& x) {
  const std::optional<int64_t> stride = uniform_row_stride(x);
  return {stride ? x : x.contiguous(), stride.value_or(x.size(-1))};
}

}  // namespace fusionlab_cpu
