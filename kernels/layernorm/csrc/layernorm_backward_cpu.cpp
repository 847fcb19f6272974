// Fused LayerNorm backward for CPU, and `layer_norm_cpu_fused_grad`: the forward of
// layer_norm_cpu whose autograd backward is this kernel instead of kernels/norm_grads.py's ops.
//
// With mean m, r = rsqrt(var + eps), xhat = (x - m) * r, gw = g * weight (g: upstream gradient):
//   dx = r * (gw - mean(gw) - xhat * mean(gw * xhat)),
//   dweight = sum over rows of g * xhat,   dbias = sum over rows of g.
// Three reads of each row, which stays in the core's cache after the first: Welford moments of
// x (welford_moments.h, as the forward), then the two row sums, then dx is written and g * xhat
// and g are added into the chunk's fp32 partial dweight and dbias (norm_backward_partials.h).
// Summing gw * x in the first read instead would cancel once |mean| >> std, so the moments are
// recomputed here (backward=fused), or read from what the forward saved (backward=fused-saved:
// `fusionlab::layer_norm_cpu_stats`, whose autograd kernel is here), skipping the first read.

#include "cpu_norm_common.h"
#include "norm_args.h"
#include "norm_backward_partials.h"
#include "norm_backward_rows.h"
#include "op_kernels.h"
#include "welford_moments.h"

#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace fusionlab_cpu;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The body of both backward ops: `mean` and `rstd` (fp32, one per row of x) or null to
// recompute them.
Triple layer_norm_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& bias, double eps, int64_t rows_per_task,
                           const at::Tensor* mean, const at::Tensor* rstd) {
  const int64_t hidden = x.size(-1);
  NormGrads grads = empty_grads(x, weight, &bias);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  // Any layout is accepted; a non-contiguous one is copied once.
  const at::Tensor x_in = x.contiguous();
  const at::Tensor g_in = grad_y.contiguous();
  const Fp32Param w_param(weight);
  const float* w = w_param.data();
  const float eps_f = static_cast<float>(eps);
  const bool saved = mean != nullptr;
  const at::Tensor mean_in = saved ? mean->contiguous() : at::Tensor();
  const at::Tensor rstd_in = saved ? rstd->contiguous() : at::Tensor();
  const float* mean_ptr = saved ? mean_in.const_data_ptr<float>() : nullptr;
  const float* rstd_ptr = saved ? rstd_in.const_data_ptr<float>() : nullptr;
  AT_DISPATCH_V2(x.scalar_type(), "layer_norm_cpu_backward_fused", AT_WRAP([&] {
    const scalar_t* x_ptr = x_in.const_data_ptr<scalar_t>();
    const scalar_t* g_ptr = g_in.const_data_ptr<scalar_t>();
    scalar_t* dx_ptr = grads.x.mutable_data_ptr<scalar_t>();
    sum_param_grads(rows, hidden, rows_per_task, grads, [&](int64_t r, float* dw, float* db) {
      const int64_t at = r * hidden;
      const RowOf<scalar_t> row{x_ptr + at};
      if (saved) {
        layer_norm_backward_row_with(row, g_ptr + at, nullptr, w, dx_ptr + at, dw, db, hidden,
                                     mean_ptr[r], rstd_ptr[r]);
      } else {
        layer_norm_backward_row(row, g_ptr + at, nullptr, w, dx_ptr + at, dw, db, hidden, eps_f);
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {grads.x, grads.weight, grads.bias};
}

Triple layer_norm_cpu_backward_fused(const at::Tensor& grad_y, const at::Tensor& x,
                                     const at::Tensor& weight, const at::Tensor& bias, double eps,
                                     int64_t rows_per_task) {
  check_backward_args("fusionlab::layer_norm_cpu_backward_fused", grad_y,
                      {x, nullptr, weight, &bias}, rows_per_task);
  return layer_norm_backward(grad_y, x, weight, bias, eps, rows_per_task, nullptr, nullptr);
}

// The fused backward reading each row's mean and rstd (layer_norm_cpu_stats's outputs).
Triple layer_norm_cpu_backward_saved(const at::Tensor& grad_y, const at::Tensor& x,
                                     const at::Tensor& weight, const at::Tensor& bias,
                                     const at::Tensor& mean, const at::Tensor& rstd,
                                     int64_t rows_per_task) {
  constexpr const char* kOp = "fusionlab::layer_norm_cpu_backward_saved";
  check_backward_args(kOp, grad_y, {x, nullptr, weight, &bias}, rows_per_task);
  const auto rows_shape = x.sizes().slice(0, x.dim() - 1);
  for (const at::Tensor* stat : {&mean, &rstd}) {
    TORCH_CHECK(stat->device().is_cpu() && stat->scalar_type() == at::kFloat &&
                    stat->sizes() == rows_shape,
                kOp, ": mean and rstd must be float32 of x's shape without its last dim, got ",
                stat->scalar_type(), " ", stat->sizes());
  }
  return layer_norm_backward(grad_y, x, weight, bias, 0.0, rows_per_task, &mean, &rstd);
}

using ForwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    double, int64_t, c10::string_view, c10::string_view,
                                    int64_t);

// layer_norm_cpu itself (layernorm_cpu.cpp, loaded first by kernels/layernorm/cpu_backward.py).
constexpr auto forward_op = op_handle<ForwardSignature, "fusionlab::layer_norm_cpu">;

class LayerNormFusedGradFunction : public torch::autograd::Function<LayerNormFusedGradFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, double eps, int64_t rows_per_task,
                            const std::string& store, const std::string& stats,
                            int64_t row_group, c10::DispatchKeySet below) {
    ctx->save_for_backward({x, weight, bias});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["rows_per_task"] = rows_per_task;
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().redispatch(below, x, weight, bias, eps, rows_per_task, store, stats,
                                   row_group);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& backward_op =
        op_handle<Triple(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         double, int64_t),
                  "fusionlab::layer_norm_cpu_backward_fused">();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight, grad_bias] =
        backward_op.call(grads[0], saved[0], saved[1], saved[2],
                         ctx->saved_data["eps"].toDouble(),
                         ctx->saved_data["rows_per_task"].toInt());
    return {grad_x, grad_weight, grad_bias, {}, {}, {}, {}, {}, {}};
  }
};

// Without autograd (inference mode): the forward alone.
at::Tensor layer_norm_cpu_fused_grad(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias, double eps, int64_t rows_per_task,
                                     c10::string_view store, c10::string_view stats,
                                     int64_t row_group) {
  return forward_op().call(x, weight, bias, eps, rows_per_task, store, stats, row_group);
}

at::Tensor layer_norm_cpu_fused_grad_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                              const at::Tensor& weight, const at::Tensor& bias,
                                              double eps, int64_t rows_per_task,
                                              c10::string_view store, c10::string_view stats,
                                              int64_t row_group) {
  return redispatch_or_record<LayerNormFusedGradFunction>(
      keys, forward_op(), needs_grad(x, weight, bias), x, weight, bias, eps, rows_per_task, store,
      stats, row_group);
}

// layer_norm_cpu_stats (layernorm_cpu.cpp): y and each row's mean and r, which the backward reads.
constexpr auto stats_op =
    op_handle<Triple(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                     c10::string_view, c10::string_view, int64_t),
              "fusionlab::layer_norm_cpu_stats">;

class LayerNormSavedStatsFunction
    : public torch::autograd::Function<LayerNormSavedStatsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& weight, const at::Tensor& bias, double eps,
                               int64_t rows_per_task, const std::string& store,
                               const std::string& stats, int64_t row_group,
                               c10::DispatchKeySet below) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mean, rstd] = stats_op().redispatch(below, x, weight, bias, eps, rows_per_task,
                                                 store, stats, row_group);
    ctx->save_for_backward({x, weight, bias, mean, rstd});
    ctx->mark_non_differentiable({mean, rstd});
    ctx->saved_data["rows_per_task"] = rows_per_task;
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& backward_op =
        op_handle<Triple(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, int64_t),
                  "fusionlab::layer_norm_cpu_backward_saved">();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight, grad_bias] =
        backward_op.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                         ctx->saved_data["rows_per_task"].toInt());
    return {grad_x, grad_weight, grad_bias, {}, {}, {}, {}, {}, {}};
  }
};

Triple layer_norm_cpu_stats_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                     const at::Tensor& weight, const at::Tensor& bias, double eps,
                                     int64_t rows_per_task, c10::string_view store,
                                     c10::string_view stats, int64_t row_group) {
  return redispatch_or_record<LayerNormSavedStatsFunction>(
      keys, stats_op(), needs_grad(x, weight, bias), x, weight, bias, eps, rows_per_task, store,
      stats, row_group);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  def_cpu(m,
          "layer_norm_cpu_backward_fused(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, "
          "float eps, int rows_per_task) -> (Tensor, Tensor, Tensor)",
          &layer_norm_cpu_backward_fused);
  def_cpu(m,
          "layer_norm_cpu_backward_saved(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, "
          "Tensor mean, Tensor rstd, int rows_per_task) -> (Tensor, Tensor, Tensor)",
          &layer_norm_cpu_backward_saved);
  def_cpu_autograd(m,
                   "layer_norm_cpu_fused_grad(Tensor x, Tensor weight, Tensor bias, float eps, "
                   "int rows_per_task, str store=\"auto\", str stats=\"welford\", "
                   "int row_group=1) -> Tensor",
                   &layer_norm_cpu_fused_grad, &layer_norm_cpu_fused_grad_autograd);
  impl_autograd(m, "layer_norm_cpu_stats", &layer_norm_cpu_stats_autograd);
}
