// Fused RMSNorm backward for CPU, and `rms_norm_cpu_fused_grad`: the forward of rms_norm_cpu
// whose autograd backward is this kernel instead of kernels/norm_grads.py's torch ops.
//
// With r = rsqrt(mean(x^2) + eps), w' = weight + offset and g the upstream gradient:
//   dx = r * g * w' - x * r^3 * mean(g * w' * x),    dweight = sum over rows of g * x * r.
// Two passes per row, fp32 accumulation: pass 1 reads x and g once for both sums (sum of x^2
// and sum of g * w' * x), pass 2 writes dx and adds g * x * r into the chunk's fp32 partial
// dweight (norm_backward_partials.h). r is recomputed in pass 1 (backward=fused): pass 1 has to
// read x and g for the dot product anyway, so r costs one FMA per element there. Or the forward
// saves it (backward=fused-saved: `fusionlab::rms_norm_cpu_stats`, whose autograd kernel is here)
// and pass 1 sums the dot product alone.
// "llama" casting's rounding of the normalised row is passed straight through, as autograd does.

#include "cpu_norm_common.h"
#include "norm_args.h"
#include "norm_backward_partials.h"
#include "norm_backward_rows.h"
#include "op_kernels.h"

#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace fusionlab_cpu;
using Pair = std::tuple<at::Tensor, at::Tensor>;

// The body of both backward ops: `rstd` (fp32, one per row of x) or null to recompute it.
Pair rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                       double eps, double offset, int64_t rows_per_task, const at::Tensor* rstd) {
  const int64_t hidden = x.size(-1);
  NormGrads grads = empty_grads(x, weight, nullptr);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  // Any layout is accepted; a non-contiguous one is copied once.
  const at::Tensor x_in = x.contiguous();
  const at::Tensor g_in = grad_y.contiguous();
  const Fp32Param w_param(weight, static_cast<float>(offset));
  const float* w = w_param.data();
  const float eps_f = static_cast<float>(eps);
  const at::Tensor rstd_in = rstd == nullptr ? at::Tensor() : rstd->contiguous();
  const float* rstd_ptr = rstd == nullptr ? nullptr : rstd_in.const_data_ptr<float>();
  AT_DISPATCH_V2(x.scalar_type(), "rms_norm_cpu_backward_fused", AT_WRAP([&] {
    const scalar_t* x_ptr = x_in.const_data_ptr<scalar_t>();
    const scalar_t* g_ptr = g_in.const_data_ptr<scalar_t>();
    scalar_t* dx_ptr = grads.x.mutable_data_ptr<scalar_t>();
    sum_param_grads(rows, hidden, rows_per_task, grads, [&](int64_t r, float* dw, float*) {
      const int64_t at = r * hidden;
      const RowOf<scalar_t> row{x_ptr + at};
      if (rstd_ptr != nullptr) {
        rms_norm_backward_row<true>(row, g_ptr + at, nullptr, w, dx_ptr + at, dw, hidden, eps_f,
                                    rstd_ptr[r]);
      } else {
        rms_norm_backward_row(row, g_ptr + at, nullptr, w, dx_ptr + at, dw, hidden, eps_f);
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {grads.x, grads.weight};
}

Pair rms_norm_cpu_backward_fused(const at::Tensor& grad_y, const at::Tensor& x,
                                 const at::Tensor& weight, double eps, double offset,
                                 int64_t rows_per_task) {
  check_backward_args("fusionlab::rms_norm_cpu_backward_fused", grad_y,
                      {x, nullptr, weight, nullptr}, rows_per_task);
  return rms_norm_backward(grad_y, x, weight, eps, offset, rows_per_task, nullptr);
}

// The fused backward reading each row's r from `rstd` (rms_norm_cpu_stats's second output).
Pair rms_norm_cpu_backward_saved(const at::Tensor& grad_y, const at::Tensor& x,
                                 const at::Tensor& weight, const at::Tensor& rstd, double offset,
                                 int64_t rows_per_task) {
  constexpr const char* kOp = "fusionlab::rms_norm_cpu_backward_saved";
  check_backward_args(kOp, grad_y, {x, nullptr, weight, nullptr}, rows_per_task);
  TORCH_CHECK(rstd.device().is_cpu() && rstd.scalar_type() == at::kFloat &&
                  rstd.sizes() == x.sizes().slice(0, x.dim() - 1),
              kOp, ": rstd must be float32 of x's shape without its last dim, got ",
              rstd.scalar_type(), " ", rstd.sizes());
  return rms_norm_backward(grad_y, x, weight, 0.0, offset, rows_per_task, &rstd);
}

using ForwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t,
                                    c10::string_view, double, c10::string_view);

// rms_norm_cpu itself (rmsnorm_cpu.cpp, loaded first by kernels/rmsnorm/cpu_backward.py).
constexpr auto forward_op = op_handle<ForwardSignature, "fusionlab::rms_norm_cpu">;

class RMSNormFusedGradFunction : public torch::autograd::Function<RMSNormFusedGradFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, int64_t rows_per_task, const std::string& casting,
                            double offset, const std::string& store,
                            c10::DispatchKeySet below) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["rows_per_task"] = rows_per_task;
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().redispatch(below, x, weight, eps, rows_per_task, casting, offset, store);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& backward_op =
        op_handle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                       int64_t),
                  "fusionlab::rms_norm_cpu_backward_fused">();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight] = backward_op.call(
        grads[0], saved[0], saved[1], ctx->saved_data["eps"].toDouble(),
        ctx->saved_data["offset"].toDouble(), ctx->saved_data["rows_per_task"].toInt());
    return {grad_x, grad_weight, {}, {}, {}, {}, {}, {}};
  }
};

// Without autograd (inference mode): the forward alone.
at::Tensor rms_norm_cpu_fused_grad(const at::Tensor& x, const at::Tensor& weight, double eps,
                                   int64_t rows_per_task, c10::string_view casting, double offset,
                                   c10::string_view store) {
  return forward_op().call(x, weight, eps, rows_per_task, casting, offset, store);
}

at::Tensor rms_norm_cpu_fused_grad_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                            const at::Tensor& weight, double eps,
                                            int64_t rows_per_task, c10::string_view casting,
                                            double offset, c10::string_view store) {
  return redispatch_or_record<RMSNormFusedGradFunction>(keys, forward_op(), needs_grad(x, weight),
                                                        x, weight, eps, rows_per_task, casting,
                                                        offset, store);
}

// rms_norm_cpu_stats (rmsnorm_cpu.cpp): y and each row's r, which the backward reads.
constexpr auto stats_op =
    op_handle<Pair(const at::Tensor&, const at::Tensor&, double, int64_t, c10::string_view, double,
                   c10::string_view),
              "fusionlab::rms_norm_cpu_stats">;

class RMSNormSavedStatsFunction : public torch::autograd::Function<RMSNormSavedStatsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& weight, double eps, int64_t rows_per_task,
                               const std::string& casting, double offset,
                               const std::string& store, c10::DispatchKeySet below) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] =
        stats_op().redispatch(below, x, weight, eps, rows_per_task, casting, offset, store);
    ctx->save_for_backward({x, weight, rstd});
    ctx->mark_non_differentiable({rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["rows_per_task"] = rows_per_task;
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& backward_op =
        op_handle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       double, int64_t),
                  "fusionlab::rms_norm_cpu_backward_saved">();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight] = backward_op.call(
        grads[0], saved[0], saved[1], saved[2], ctx->saved_data["offset"].toDouble(),
        ctx->saved_data["rows_per_task"].toInt());
    return {grad_x, grad_weight, {}, {}, {}, {}, {}, {}};
  }
};

Pair rms_norm_cpu_stats_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                 const at::Tensor& weight, double eps, int64_t rows_per_task,
                                 c10::string_view casting, double offset,
                                 c10::string_view store) {
  return redispatch_or_record<RMSNormSavedStatsFunction>(
      keys, stats_op(), needs_grad(x, weight), x, weight, eps, rows_per_task, casting, offset,
      store);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  def_cpu(m,
          "rms_norm_cpu_backward_fused(Tensor grad_y, Tensor x, Tensor weight, float eps, "
          "float offset, int rows_per_task) -> (Tensor, Tensor)",
          &rms_norm_cpu_backward_fused);
  def_cpu(m,
          "rms_norm_cpu_backward_saved(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd, "
          "float offset, int rows_per_task) -> (Tensor, Tensor)",
          &rms_norm_cpu_backward_saved);
  def_cpu_autograd(m,
                   "rms_norm_cpu_fused_grad(Tensor x, Tensor weight, float eps, "
                   "int rows_per_task, str casting=\"none\", float offset=0.0, "
                   "str store=\"auto\") -> Tensor",
                   &rms_norm_cpu_fused_grad, &rms_norm_cpu_fused_grad_autograd);
  impl_autograd(m, "rms_norm_cpu_stats", &rms_norm_cpu_stats_autograd);
}
