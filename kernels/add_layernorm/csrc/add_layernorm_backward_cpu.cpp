// Fused add + LayerNorm backward for CPU, and `add_layer_norm_cpu_fused_grad`: the forward of
// add_layer_norm_cpu whose autograd backward is this kernel instead of kernels/norm_grads.py's
// ops.
//
// With s = x + residual formed in fp32 (as the forward forms it), the LayerNorm gradient of s is
// layernorm's (norm_backward_rows.h), plus the upstream gradient of residual_out (= s) when that
// output is used; it is both dx and dresidual. One row block at a time: Welford moments of s
// (welford_moments.h, as the forward), the two row sums, then ds is written and g * shat and g
// are added into the chunk's fp32 partial dweight and dbias (norm_backward_partials.h); the
// later reads come from cache. Nothing is saved by the forward: s and its moments are recomputed.

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
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

Triple add_layer_norm_cpu_backward_fused(const at::Tensor& grad_y,
                                         const std::optional<at::Tensor>& grad_residual_out,
                                         const at::Tensor& x, const at::Tensor& residual,
                                         const at::Tensor& weight, const at::Tensor& bias,
                                         double eps, int64_t rows_per_task) {
  constexpr const char* kOp = "fusionlab::add_layer_norm_cpu_backward_fused";
  const AddBackwardInputs in =
      add_backward_inputs(kOp, grad_y, grad_residual_out, x, residual, weight, rows_per_task);
  TORCH_CHECK(bias.device().is_cpu() && bias.sizes() == weight.sizes() &&
                  is_supported_dtype(bias.scalar_type()),
              kOp, ": bias must be a CPU tensor of weight's shape in float32, bfloat16 or "
              "float16, got ", bias.sizes(), " ", bias.scalar_type());
  NormGrads grads = empty_grads(x, weight, &bias);
  const Fp32Param w_param(weight);
  const float* w = w_param.data();
  const int64_t n = in.hidden;
  const float eps_f = static_cast<float>(eps);
  AT_DISPATCH_V2(x.scalar_type(), "add_layer_norm_cpu_backward_fused", AT_WRAP([&] {
    const AddBackwardRows<scalar_t> rows(in);
    scalar_t* dx_ptr = grads.x.mutable_data_ptr<scalar_t>();
    sum_param_grads(in.rows, n, rows_per_task, grads, [&](int64_t row, float* dw, float* db) {
      const int64_t at = row * n;
      layer_norm_backward_row(rows.sum(at), rows.grad_y + at, rows.g_sum(at), w, dx_ptr + at, dw,
                              db, n, eps_f);
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {grads.x, grads.weight, grads.bias};
}

// add_layer_norm_cpu itself (add_layernorm_cpu.cpp, loaded first by
// kernels/add_layernorm/cpu_backward.py).
constexpr auto forward_op =
    op_handle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   double, int64_t, c10::string_view, c10::string_view, int64_t),
              "fusionlab::add_layer_norm_cpu">;

class AddLayerNormFusedGradFunction
    : public torch::autograd::Function<AddLayerNormFusedGradFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& residual, const at::Tensor& weight,
                               const at::Tensor& bias, double eps, int64_t rows_per_task,
                               const std::string& store, const std::string& stats,
                               int64_t row_group, c10::DispatchKeySet below) {
    // An unused output's gradient stays undefined: the kernel then skips adding it.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, residual, weight, bias});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["rows_per_task"] = rows_per_task;
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, res] = forward_op().redispatch(below, x, residual, weight, bias, eps,
                                              rows_per_task, store, stats, row_group);
    return {out, res};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& backward_op =
        op_handle<Triple(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t),
                  "fusionlab::add_layer_norm_cpu_backward_fused">();
    const variable_list saved = ctx->get_saved_variables();
    const AddGrads upstream = add_upstream_grads(grads, saved[0]);
    auto [grad_total, grad_weight, grad_bias] = backward_op.call(
        upstream.grad_y, upstream.grad_sum, saved[0], saved[1], saved[2], saved[3],
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["rows_per_task"].toInt());
    return {grad_total, grad_total, grad_weight, grad_bias, {}, {}, {}, {}, {}, {}};
  }
};

// Without autograd (inference mode): the forward alone.
Pair add_layer_norm_cpu_fused_grad(const at::Tensor& x, const at::Tensor& residual,
                                   const at::Tensor& weight, const at::Tensor& bias, double eps,
                                   int64_t rows_per_task, c10::string_view store,
                                   c10::string_view stats, int64_t row_group) {
  return forward_op().call(x, residual, weight, bias, eps, rows_per_task, store, stats,
                           row_group);
}

Pair add_layer_norm_cpu_fused_grad_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                            const at::Tensor& residual, const at::Tensor& weight,
                                            const at::Tensor& bias, double eps,
                                            int64_t rows_per_task, c10::string_view store,
                                            c10::string_view stats, int64_t row_group) {
  return redispatch_or_record<AddLayerNormFusedGradFunction>(
      keys, forward_op(), needs_grad(x, residual, weight, bias), x, residual, weight, bias, eps,
      rows_per_task, store, stats, row_group);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  def_cpu(m,
          "add_layer_norm_cpu_backward_fused(Tensor grad_y, Tensor? grad_residual_out, "
          "Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps, "
          "int rows_per_task) -> (Tensor, Tensor, Tensor)",
          &add_layer_norm_cpu_backward_fused);
  def_cpu_autograd(m,
                   "add_layer_norm_cpu_fused_grad(Tensor x, Tensor residual, Tensor weight, "
                   "Tensor bias, float eps, int rows_per_task, str store=\"auto\", "
                   "str stats=\"welford\", int row_group=1) -> (Tensor, Tensor)",
                   &add_layer_norm_cpu_fused_grad, &add_layer_norm_cpu_fused_grad_autograd);
}
