// Fused add + RMSNorm backward for CPU, and `add_rms_norm_cpu_fused_grad`: the forward of
// add_rms_norm_cpu whose autograd backward is this kernel instead of kernels/norm_grads.py's ops.
//
// With s = x + residual (formed in fp32 as the forward forms it, rounded to x's dtype first under
// casting "llama" and "gemma"), the RMSNorm gradient of s is rmsnorm's (norm_backward_rows.h),
// plus the upstream gradient of residual_out (= s) when that output is used; it is both dx and
// dresidual. One row block at a time: pass 1 reads x, residual and g for sum(s^2) and
// sum(g * w * s); pass 2, from cache, writes ds and adds g * s * r into the chunk's fp32 partial
// dweight (norm_backward_partials.h). Nothing is saved by the forward: s and r are recomputed.

#include "add_norm_backward.h"
#include "cpu_norm_common.h"
#include "norm_backward_partials.h"
#include "norm_backward_rows.h"

#include <ATen/EmptyTensor.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace fusionlab_cpu;
using Pair = std::tuple<at::Tensor, at::Tensor>;

Pair add_rms_norm_cpu_backward_fused(const at::Tensor& grad_y,
                                     const std::optional<at::Tensor>& grad_residual_out,
                                     const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps, double offset,
                                     bool round_sum, int64_t rows_per_task) {
  const bool has_grad_sum = grad_residual_out.has_value() && grad_residual_out->defined();
  const AddBackwardInputs in = add_backward_inputs(
      "fusionlab::add_rms_norm_cpu_backward_fused", grad_y,
      has_grad_sum ? *grad_residual_out : grad_y, x, residual, weight, rows_per_task);
  at::Tensor grad_sum(at::detail::empty_cpu(x.sizes(), x.scalar_type()));
  at::Tensor grad_weight(at::detail::empty_cpu(weight.sizes(), weight.scalar_type()));
  if (in.rows == 0) {
    grad_weight.zero_();
    return {grad_sum, grad_weight};
  }
  std::vector<float> w_widened;
  const at::Tensor w_in = weight.contiguous();
  const float* w = widen_to_float(w_in, w_widened, static_cast<float>(offset));
  const RowChunks chunks = plan_chunks(in.rows, rows_per_task);
  std::vector<float> partials(chunks.count * in.hidden, 0.f);
  const float eps_f = static_cast<float>(eps);
  const int64_t n = in.hidden;
  AT_DISPATCH_V2(x.scalar_type(), "add_rms_norm_cpu_backward_fused", AT_WRAP([&] {
    const scalar_t* x_ptr = in.x.const_data_ptr<scalar_t>();
    const scalar_t* r_ptr = in.residual.const_data_ptr<scalar_t>();
    const scalar_t* g_ptr = in.grad_y.const_data_ptr<scalar_t>();
    const scalar_t* gs_ptr = has_grad_sum ? in.grad_sum.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* dx_ptr = grad_sum.mutable_data_ptr<scalar_t>();
    for_each_chunk(chunks, in.rows, [&](int64_t chunk, int64_t begin, int64_t end) {
      float* dw = partials.data() + chunk * n;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t at = row * n;
        const scalar_t* gs = gs_ptr != nullptr ? gs_ptr + at : nullptr;
        if (round_sum) {
          rms_norm_backward_row(RoundedSumOf<scalar_t>{x_ptr + at, r_ptr + at}, g_ptr + at, gs, w,
                                dx_ptr + at, dw, n, eps_f);
        } else {
          rms_norm_backward_row(SumOf<scalar_t>{x_ptr + at, r_ptr + at}, g_ptr + at, gs, w,
                                dx_ptr + at, dw, n, eps_f);
        }
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  reduce_partials(partials, chunks.count, n, grad_weight);
  return {grad_sum, grad_weight};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// add_rms_norm_cpu itself (add_rmsnorm_cpu.cpp, loaded first by
// kernels/add_rmsnorm/cpu_backward.py).
const auto& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fusionlab::add_rms_norm_cpu", "")
          .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                      c10::string_view, double, c10::string_view)>();
  return op;
}

class AddRMSNormFusedGradFunction
    : public torch::autograd::Function<AddRMSNormFusedGradFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& residual, const at::Tensor& weight, double eps,
                               int64_t rows_per_task, const std::string& casting, double offset,
                               const std::string& store, c10::DispatchKeySet below) {
    // An unused output's gradient stays undefined: the kernel then skips adding it.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, residual, weight});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["round_sum"] = casting != "none";
    ctx->saved_data["rows_per_task"] = rows_per_task;
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, res] = forward_op().redispatch(below, x, residual, weight, eps, rows_per_task,
                                              casting, offset, store);
    return {out, res};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("fusionlab::add_rms_norm_cpu_backward_fused", "")
            .typed<Pair(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, double, double, bool, int64_t)>();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor grad_y = grads[0].defined() ? grads[0] : at::zeros_like(saved[0]);
    const std::optional<at::Tensor> grad_sum =
        grads[1].defined() ? std::optional<at::Tensor>(grads[1]) : std::nullopt;
    auto [grad_total, grad_weight] = backward_op.call(
        grad_y, grad_sum, saved[0], saved[1], saved[2], ctx->saved_data["eps"].toDouble(),
        ctx->saved_data["offset"].toDouble(), ctx->saved_data["round_sum"].toBool(),
        ctx->saved_data["rows_per_task"].toInt());
    return {grad_total, grad_total, grad_weight, {}, {}, {}, {}, {}, {}};
  }
};

// Without autograd (inference mode): the forward alone.
Pair add_rms_norm_cpu_fused_grad(const at::Tensor& x, const at::Tensor& residual,
                                 const at::Tensor& weight, double eps, int64_t rows_per_task,
                                 c10::string_view casting, double offset,
                                 c10::string_view store) {
  return forward_op().call(x, residual, weight, eps, rows_per_task, casting, offset, store);
}

Pair add_rms_norm_cpu_fused_grad_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                          const at::Tensor& residual, const at::Tensor& weight,
                                          double eps, int64_t rows_per_task,
                                          c10::string_view casting, double offset,
                                          c10::string_view store) {
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  if (!needs_grad(x, residual, weight)) {
    return forward_op().redispatch(below, x, residual, weight, eps, rows_per_task, casting,
                                   offset, store);
  }
  variable_list outputs = AddRMSNormFusedGradFunction::apply(
      x, residual, weight, eps, rows_per_task, std::string(casting), offset, std::string(store),
      below);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  m.def("add_rms_norm_cpu_backward_fused(Tensor grad_y, Tensor? grad_residual_out, Tensor x, "
        "Tensor residual, Tensor weight, float eps, float offset, bool round_sum, "
        "int rows_per_task) -> (Tensor, Tensor)");
  m.def("add_rms_norm_cpu_fused_grad(Tensor x, Tensor residual, Tensor weight, float eps, "
        "int rows_per_task, str casting=\"none\", float offset=0.0, str store=\"auto\") "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusionlab, CPU, m) {
  m.impl("add_rms_norm_cpu_backward_fused", &add_rms_norm_cpu_backward_fused);
  m.impl("add_rms_norm_cpu_fused_grad", &add_rms_norm_cpu_fused_grad);
}

TORCH_LIBRARY_IMPL(fusionlab, Autograd, m) {
  m.impl("add_rms_norm_cpu_fused_grad", &add_rms_norm_cpu_fused_grad_autograd);
}
