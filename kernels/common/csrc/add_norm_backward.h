// What the fused backward kernels of add_rmsnorm and add_layernorm share: their argument checks
// and their inputs as contiguous rows. Both take the upstream gradients of the two outputs,
// y = norm(s) and residual_out = s with s = x + residual; their dx is also d(residual).
#pragma once

#include "cpu_norm_common.h"

#include <ATen/core/Tensor.h>
#include <torch/autograd.h>

#include <cstdint>
#include <optional>

namespace fusionlab_cpu {

// The backward's row-major inputs: a non-contiguous layout is copied once. grad_sum (the upstream
// gradient of residual_out) is undefined where that output had none.
struct AddBackwardInputs {
  at::Tensor grad_y, grad_sum, x, residual;
  int64_t rows, hidden;
};

// The inputs' data as T, a row at a time (`at`: the offset of its first element).
template <typename T>
struct AddBackwardRows {
  explicit AddBackwardRows(const AddBackwardInputs& in)
      : x(in.x.const_data_ptr<T>()),
        residual(in.residual.const_data_ptr<T>()),
        grad_y(in.grad_y.const_data_ptr<T>()),
        grad_sum(in.grad_sum.defined() ? in.grad_sum.const_data_ptr<T>() : nullptr) {}

  SumOf<T> sum(int64_t at) const { return {x + at, residual + at}; }
  const T* g_sum(int64_t at) const { return grad_sum != nullptr ? grad_sum + at : nullptr; }

  const T *x, *residual, *grad_y, *grad_sum;
};

inline AddBackwardInputs add_backward_inputs(const char* op, const at::Tensor& grad_y,
                                             const std::optional<at::Tensor>& grad_residual_out,
                                             const at::Tensor& x, const at::Tensor& residual,
                                             const at::Tensor& weight, int64_t rows_per_task) {
  const bool has_grad_sum = grad_residual_out.has_value() && grad_residual_out->defined();
  const at::Tensor& grad_sum = has_grad_sum ? *grad_residual_out : grad_y;
  for (const at::Tensor* t : {&grad_y, &grad_sum, &x, &residual, &weight}) {
    TORCH_CHECK(t->device().is_cpu(), op, ": tensors must be on the CPU, got ", t->device());
  }
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dim");
  for (const at::Tensor* t : {&grad_y, &grad_sum, &residual}) {
    TORCH_CHECK(t->sizes() == x.sizes(), op, ": grad_y, grad_residual_out and residual must have ",
                "x's shape ", x.sizes(), ", got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), op, ": grad_y, grad_residual_out and ",
                "residual must have x's dtype ", x.scalar_type(), ", got ", t->scalar_type());
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op,
              ": weight must be 1-D of size x.size(-1), got ", weight.sizes());
  TORCH_CHECK(is_supported_dtype(x.scalar_type()) && is_supported_dtype(weight.scalar_type()), op,
              ": dtypes must be float32, bfloat16 or float16, got x ", x.scalar_type(),
              " and weight ", weight.scalar_type());
  TORCH_CHECK(rows_per_task >= 1, op, ": rows_per_task must be >= 1, got ", rows_per_task);
  const int64_t hidden = x.size(-1);
  return {grad_y.contiguous(), has_grad_sum ? grad_sum.contiguous() : at::Tensor(),
          x.contiguous(), residual.contiguous(), hidden == 0 ? 0 : x.numel() / hidden, hidden};
}

// The upstream gradients an add kernel's autograd Function hands its backward op: grad_y (zeros
// where y was unused) and grad_residual_out (none where residual_out was unused, so the kernel
// skips adding it). The Function does not materialize them, so either may be undefined.
struct AddGrads {
  at::Tensor grad_y;
  std::optional<at::Tensor> grad_sum;
};

inline AddGrads add_upstream_grads(const torch::autograd::variable_list& grads,
                                   const at::Tensor& x) {
  return {grads[0].defined() ? grads[0] : at::zeros_like(x),
          grads[1].defined() ? std::optional<at::Tensor>(grads[1]) : std::nullopt};
}

}  // namespace fusionlab_cpu
