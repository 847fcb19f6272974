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
#include "op_kernels.h"

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
  const AddBackwardInputs in =
      add_backward_inputs("fusionlab::add_rms_norm_cpu_backward_fused", grad_y,
                          grad_residual_out, x, residual, weight, rows_per_task);
  NormGrads grads = empty_grads(x, weight, nullptr);
  const Fp32Param w_param(weight, static_cast<float>(offset));
  const float* w = w_param.data();
  const float eps_f = static_cast<float>(eps);
  const int64_t n = in.hidden;
  AT_DISPATCH_V2(x.scalar_type(), "add_rms_norm_cpu_backward_fused", AT_WRAP([&] {
    const AddBackwardRows<scalar_t> rows(in);
    scalar_t* dx_ptr = grads.x.mutable_data_ptr<scalar_t>();
    sum_param_grads(in.rows, n, rows_per_task, grads, [&](int64_t row, float* dw, float*) {
      const int64_t at = row * n;
      const SumOf<scalar_t> sum = rows.sum(at);
      if (round_sum) {
        rms_norm_backward_row(RoundedSumOf<scalar_t>{sum.x, sum.r}, rows.grad_y + at,
                              rows.g_sum(at), w, dx_ptr + at, dw, n, eps_f);
      } else {
        rms_norm_backward_row(sum, rows.grad_y + at, rows.g_sum(at), w, dx_ptr + at, dw, n,
                              eps_f);
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {grads.x, grads.weight};
}

// add_rms_norm_cpu itself (add_rmsnorm_cpu.cpp, loaded first by
// kernels/add_rmsnorm/cpu_backward.py).
constexpr auto forward_op =
    op_handle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                   c10::string_view, double, c10::string_view),
              "fusionlab::add_rms_norm_cpu">;

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
    const auto& backward_op =
        op_handle<Pair(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, double, double, bool, int64_t),
                  "fusionlab::add_rms_norm_cpu_backward_fused">();
    const variable_list saved = ctx->get_saved_variables();
    const AddGrads upstream = add_upstream_grads(grads, saved[0]);
    auto [grad_total, grad_weight] = backward_op.call(
        upstream.grad_y, upstream.grad_sum, saved[0], saved[1], saved[2],
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["offset"].toDouble(),
        ctx->saved_data["round_sum"].toBool(), ctx->saved_data["rows_per_task"].toInt());
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
  return redispatch_or_record<AddRMSNormFusedGradFunction>(
      keys, forward_op(), needs_grad(x, residual, weight), x, residual, weight, eps,
      rows_per_task, casting, offset, store);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  def_cpu(m,
          "add_rms_norm_cpu_backward_fused(Tensor grad_y, Tensor? grad_residual_out, Tensor x, "
          "Tensor residual, Tensor weight, float eps, float offset, bool round_sum, "
          "int rows_per_task) -> (Tensor, Tensor)",
          &add_rms_norm_cpu_backward_fused);
  def_cpu_autograd(m,
                   "add_rms_norm_cpu_fused_grad(Tensor x, Tensor residual, Tensor weight, "
                   "float eps, int rows_per_task, str casting=\"none\", float offset=0.0, "
                   "str store=\"auto\") -> (Tensor, Tensor)",
                   &add_rms_norm_cpu_fused_grad, &add_rms_norm_cpu_fused_grad_autograd);
}
