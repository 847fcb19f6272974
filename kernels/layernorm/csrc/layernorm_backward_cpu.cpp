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
#include "norm_backward_partials.h"
#include "welford_moments.h"

#include <ATen/EmptyTensor.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace fusionlab_cpu;

// One row's backward given its mean and r.
template <typename T>
void layer_norm_backward_row_with(const T* g, const T* x, const float* w, T* dx, float* dw,
                                  float* db, int64_t n, float mean, float r) {
  const fVec vmean(mean), vr(r);
  fVec gw0(0.f), gw1(0.f), gwx0(0.f), gwx1(0.f);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fVec x_lo, x_hi, g_lo, g_hi;
    load_block(x + i, x_lo, x_hi);
    load_block(g + i, g_lo, g_hi);
    const fVec gw_lo = g_lo * fVec::loadu(w + i);
    const fVec gw_hi = g_hi * fVec::loadu(w + i + fVec::size());
    gw0 = gw0 + gw_lo;
    gw1 = gw1 + gw_hi;
    gwx0 = at::vec::fmadd(gw_lo, (x_lo - vmean) * vr, gwx0);
    gwx1 = at::vec::fmadd(gw_hi, (x_hi - vmean) * vr, gwx1);
  }
  const auto add = [](const fVec& u, const fVec& v) { return u + v; };
  float sum_gw = at::vec::vec_reduce_all<float>(add, gw0 + gw1);
  float sum_gw_xhat = at::vec::vec_reduce_all<float>(add, gwx0 + gwx1);
  for (; i < n; ++i) {
    const float gw = static_cast<float>(g[i]) * w[i];
    sum_gw += gw;
    sum_gw_xhat += gw * (static_cast<float>(x[i]) - mean) * r;
  }
  const float inv_n = 1.f / static_cast<float>(n);
  const float mean_gw = sum_gw * inv_n, mean_gw_xhat = sum_gw_xhat * inv_n;
  const fVec vmean_gw(mean_gw), vmean_gw_xhat(mean_gw_xhat);
  i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fVec x_lo, x_hi, g_lo, g_hi;
    load_block(x + i, x_lo, x_hi);
    load_block(g + i, g_lo, g_hi);
    const fVec xhat_lo = (x_lo - vmean) * vr, xhat_hi = (x_hi - vmean) * vr;
    const fVec gw_lo = g_lo * fVec::loadu(w + i);
    const fVec gw_hi = g_hi * fVec::loadu(w + i + fVec::size());
    store_block<false>(dx + i, vr * (gw_lo - vmean_gw - xhat_lo * vmean_gw_xhat),
                       vr * (gw_hi - vmean_gw - xhat_hi * vmean_gw_xhat));
    at::vec::fmadd(g_lo, xhat_lo, fVec::loadu(dw + i)).store(dw + i);
    at::vec::fmadd(g_hi, xhat_hi, fVec::loadu(dw + i + fVec::size())).store(dw + i + fVec::size());
    (fVec::loadu(db + i) + g_lo).store(db + i);
    (fVec::loadu(db + i + fVec::size()) + g_hi).store(db + i + fVec::size());
  }
  for (; i < n; ++i) {
    const float gv = static_cast<float>(g[i]);
    const float xhat = (static_cast<float>(x[i]) - mean) * r;
    dx[i] = static_cast<T>(r * (gv * w[i] - mean_gw - xhat * mean_gw_xhat));
    dw[i] += gv * xhat;
    db[i] += gv;
  }
}

// One row's backward, its mean and r recomputed from x as the forward computes them.
template <typename T>
void layer_norm_backward_row(const T* g, const T* x, const float* w, T* dx, float* dw, float* db,
                             int64_t n, float eps) {
  const Moments moments = row_moments(RowOf<T>{x}, n);
  const float mean = static_cast<float>(moments.mean);
  const float r = static_cast<float>(1.0 / std::sqrt(moments.m2 / moments.count + eps));
  layer_norm_backward_row_with(g, x, w, dx, dw, db, n, mean, r);
}

void check_backward_args(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias, int64_t rows_per_task, const char* kOp) {
  TORCH_CHECK(grad_y.device().is_cpu() && x.device().is_cpu() && weight.device().is_cpu() &&
                  bias.device().is_cpu(),
              kOp, ": tensors must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && grad_y.sizes() == x.sizes(), kOp,
              ": grad_y must have x's shape, got ", grad_y.sizes(), " and ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && bias.sizes() == weight.sizes(),
              kOp, ": weight and bias must be 1-D of size x.size(-1), got ", weight.sizes(),
              " and ", bias.sizes());
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type() && is_supported_dtype(x.scalar_type()) &&
                  is_supported_dtype(weight.scalar_type()) &&
                  is_supported_dtype(bias.scalar_type()),
              kOp, ": x and grad_y must share one of float32, bfloat16, float16; got ",
              x.scalar_type(), ", ", grad_y.scalar_type());
  TORCH_CHECK(rows_per_task >= 1, kOp, ": rows_per_task must be >= 1, got ", rows_per_task);
}

// The body of both backward ops: `mean` and `rstd` (fp32, one per row of x) or null to
// recompute them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& bias, double eps, int64_t rows_per_task, const at::Tensor* mean,
    const at::Tensor* rstd) {
  const int64_t hidden = x.size(-1);
  at::Tensor grad_x(at::detail::empty_cpu(x.sizes(), x.scalar_type()));
  at::Tensor grad_weight(at::detail::empty_cpu(weight.sizes(), weight.scalar_type()));
  at::Tensor grad_bias(at::detail::empty_cpu(bias.sizes(), bias.scalar_type()));
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  if (rows == 0) {
    grad_weight.zero_();
    grad_bias.zero_();
    return {grad_x, grad_weight, grad_bias};
  }
  // Any layout is accepted; a non-contiguous one is copied once.
  const at::Tensor x_in = x.contiguous();
  const at::Tensor g_in = grad_y.contiguous();
  std::vector<float> w_widened;
  const at::Tensor w_in = weight.contiguous();
  const float* w = widen_to_float(w_in, w_widened);
  const RowChunks chunks = plan_chunks(rows, rows_per_task);
  std::vector<float> dw_partials(chunks.count * hidden, 0.f);
  std::vector<float> db_partials(chunks.count * hidden, 0.f);
  const float eps_f = static_cast<float>(eps);
  const bool saved = mean != nullptr;
  const at::Tensor mean_in = saved ? mean->contiguous() : at::Tensor();
  const at::Tensor rstd_in = saved ? rstd->contiguous() : at::Tensor();
  const float* mean_ptr = saved ? mean_in.const_data_ptr<float>() : nullptr;
  const float* rstd_ptr = saved ? rstd_in.const_data_ptr<float>() : nullptr;
  AT_DISPATCH_V2(x.scalar_type(), "layer_norm_cpu_backward_fused", AT_WRAP([&] {
    const scalar_t* x_ptr = x_in.const_data_ptr<scalar_t>();
    const scalar_t* g_ptr = g_in.const_data_ptr<scalar_t>();
    scalar_t* dx_ptr = grad_x.mutable_data_ptr<scalar_t>();
    for_each_chunk(chunks, rows, [&](int64_t chunk, int64_t begin, int64_t end) {
      float* dw = dw_partials.data() + chunk * hidden;
      float* db = db_partials.data() + chunk * hidden;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t at = r * hidden;
        if (saved) {
          layer_norm_backward_row_with(g_ptr + at, x_ptr + at, w, dx_ptr + at, dw, db, hidden,
                                       mean_ptr[r], rstd_ptr[r]);
        } else {
          layer_norm_backward_row(g_ptr + at, x_ptr + at, w, dx_ptr + at, dw, db, hidden, eps_f);
        }
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  reduce_partials(dw_partials, chunks.count, hidden, grad_weight);
  reduce_partials(db_partials, chunks.count, hidden, grad_bias);
  return {grad_x, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cpu_backward_fused(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& bias, double eps, int64_t rows_per_task) {
  check_backward_args(grad_y, x, weight, bias, rows_per_task,
                      "fusionlab::layer_norm_cpu_backward_fused");
  return layer_norm_backward(grad_y, x, weight, bias, eps, rows_per_task, nullptr, nullptr);
}

// The fused backward reading each row's mean and rstd (layer_norm_cpu_stats's outputs).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cpu_backward_saved(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& rstd,
    int64_t rows_per_task) {
  constexpr const char* kOp = "fusionlab::layer_norm_cpu_backward_saved";
  check_backward_args(grad_y, x, weight, bias, rows_per_task, kOp);
  const auto rows_shape = x.sizes().slice(0, x.dim() - 1);
  for (const at::Tensor* stat : {&mean, &rstd}) {
    TORCH_CHECK(stat->device().is_cpu() && stat->scalar_type() == at::kFloat &&
                    stat->sizes() == rows_shape,
                kOp, ": mean and rstd must be float32 of x's shape without its last dim, got ",
                stat->scalar_type(), " ", stat->sizes());
  }
  return layer_norm_backward(grad_y, x, weight, bias, 0.0, rows_per_task, &mean, &rstd);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    double, int64_t, c10::string_view, c10::string_view,
                                    int64_t);

// layer_norm_cpu itself (layernorm_cpu.cpp, loaded first by kernels/layernorm/cpu_backward.py).
const auto& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusionlab::layer_norm_cpu", "")
                             .typed<ForwardSignature>();
  return op;
}

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
    static const auto backward_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("fusionlab::layer_norm_cpu_backward_fused", "")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                double, int64_t)>();
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
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  if (!needs_grad(x, weight, bias)) {
    return forward_op().redispatch(below, x, weight, bias, eps, rows_per_task, store, stats,
                                   row_group);
  }
  return LayerNormFusedGradFunction::apply(x, weight, bias, eps, rows_per_task,
                                           std::string(store), std::string(stats), row_group,
                                           below);
}

using StatsSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, c10::string_view,
    c10::string_view, int64_t);

// layer_norm_cpu_stats (layernorm_cpu.cpp): y and each row's mean and r, which the backward reads.
const auto& stats_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusionlab::layer_norm_cpu_stats", "")
                             .typed<StatsSignature>();
  return op;
}

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
    static const auto backward_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("fusionlab::layer_norm_cpu_backward_saved", "")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                const at::Tensor&, const at::Tensor&, int64_t)>();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight, grad_bias] =
        backward_op.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                         ctx->saved_data["rows_per_task"].toInt());
    return {grad_x, grad_weight, grad_bias, {}, {}, {}, {}, {}, {}};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cpu_stats_autograd(
    c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& bias, double eps, int64_t rows_per_task, c10::string_view store,
    c10::string_view stats, int64_t row_group) {
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  if (!needs_grad(x, weight, bias)) {
    return stats_op().redispatch(below, x, weight, bias, eps, rows_per_task, store, stats,
                                 row_group);
  }
  const variable_list out = LayerNormSavedStatsFunction::apply(
      x, weight, bias, eps, rows_per_task, std::string(store), std::string(stats), row_group,
      below);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  m.def("layer_norm_cpu_backward_fused(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, "
        "float eps, int rows_per_task) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_cpu_backward_saved(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, "
        "Tensor mean, Tensor rstd, int rows_per_task) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_cpu_fused_grad(Tensor x, Tensor weight, Tensor bias, float eps, "
        "int rows_per_task, str store=\"auto\", str stats=\"welford\", int row_group=1) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(fusionlab, CPU, m) {
  m.impl("layer_norm_cpu_backward_fused", &layer_norm_cpu_backward_fused);
  m.impl("layer_norm_cpu_backward_saved", &layer_norm_cpu_backward_saved);
  m.impl("layer_norm_cpu_fused_grad", &layer_norm_cpu_fused_grad);
}

TORCH_LIBRARY_IMPL(fusionlab, Autograd, m) {
  m.impl("layer_norm_cpu_fused_grad", &layer_norm_cpu_fused_grad_autograd);
  m.impl("layer_norm_cpu_stats", &layer_norm_cpu_stats_autograd);
}
