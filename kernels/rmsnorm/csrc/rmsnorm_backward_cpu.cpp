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
#include "norm_backward_partials.h"

#include <ATen/EmptyTensor.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace fusionlab_cpu;

// kSavedRstd: `saved_rstd` is the row's r, from the forward; else r is recomputed from x.
template <bool kSavedRstd, typename T>
void rms_norm_backward_row(const T* g, const T* x, const float* w, T* dx, float* dw, int64_t n,
                           float eps, float saved_rstd) {
  fVec sq0(0.f), sq1(0.f), dot0(0.f), dot1(0.f);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fVec x_lo, x_hi, g_lo, g_hi;
    load_block(x + i, x_lo, x_hi);
    load_block(g + i, g_lo, g_hi);
    const fVec gw_lo = g_lo * fVec::loadu(w + i);
    const fVec gw_hi = g_hi * fVec::loadu(w + i + fVec::size());
    if constexpr (!kSavedRstd) {
      sq0 = at::vec::fmadd(x_lo, x_lo, sq0);
      sq1 = at::vec::fmadd(x_hi, x_hi, sq1);
    }
    dot0 = at::vec::fmadd(gw_lo, x_lo, dot0);
    dot1 = at::vec::fmadd(gw_hi, x_hi, dot1);
  }
  const auto add = [](const fVec& u, const fVec& v) { return u + v; };
  float sum_sq = kSavedRstd ? 0.f : at::vec::vec_reduce_all<float>(add, sq0 + sq1);
  float dot = at::vec::vec_reduce_all<float>(add, dot0 + dot1);
  for (; i < n; ++i) {
    const float xv = static_cast<float>(x[i]);
    sum_sq += xv * xv;
    dot += static_cast<float>(g[i]) * w[i] * xv;
  }
  const float inv_n = 1.f / static_cast<float>(n);
  const float r = kSavedRstd ? saved_rstd : 1.f / std::sqrt(sum_sq * inv_n + eps);
  const float c = r * r * r * dot * inv_n;
  const fVec vr(r), vc(c);
  i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fVec x_lo, x_hi, g_lo, g_hi;
    load_block(x + i, x_lo, x_hi);
    load_block(g + i, g_lo, g_hi);
    const fVec w_lo = fVec::loadu(w + i);
    const fVec w_hi = fVec::loadu(w + i + fVec::size());
    store_block<false>(dx + i, vr * g_lo * w_lo - vc * x_lo, vr * g_hi * w_hi - vc * x_hi);
    const fVec dw_lo = at::vec::fmadd(g_lo * x_lo, vr, fVec::loadu(dw + i));
    const fVec dw_hi = at::vec::fmadd(g_hi * x_hi, vr, fVec::loadu(dw + i + fVec::size()));
    dw_lo.store(dw + i);
    dw_hi.store(dw + i + fVec::size());
  }
  for (; i < n; ++i) {
    const float xv = static_cast<float>(x[i]);
    const float gv = static_cast<float>(g[i]);
    dx[i] = static_cast<T>(r * gv * w[i] - c * xv);
    dw[i] += gv * xv * r;
  }
}

void check_backward_args(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                         int64_t rows_per_task, const char* op) {
  TORCH_CHECK(grad_y.device().is_cpu() && x.device().is_cpu() && weight.device().is_cpu(), op,
              ": tensors must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && grad_y.sizes() == x.sizes(), op,
              ": grad_y must have x's shape, got ", grad_y.sizes(), " and ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op,
              ": weight must be 1-D of size x.size(-1), got ", weight.sizes());
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type() && is_supported_dtype(x.scalar_type()) &&
                  is_supported_dtype(weight.scalar_type()),
              op, ": x and grad_y must share one of float32, bfloat16, float16; got ",
              x.scalar_type(), ", ", grad_y.scalar_type(), " and weight ", weight.scalar_type());
  TORCH_CHECK(rows_per_task >= 1, op, ": rows_per_task must be >= 1, got ", rows_per_task);
}

// The body of both backward ops: `rstd` (fp32, one per row of x) or null to recompute it.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, double eps,
    double offset, int64_t rows_per_task, const at::Tensor* rstd) {
  const int64_t hidden = x.size(-1);
  at::Tensor grad_x(at::detail::empty_cpu(x.sizes(), x.scalar_type()));
  at::Tensor grad_weight(at::detail::empty_cpu(weight.sizes(), weight.scalar_type()));
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  if (rows == 0) {
    grad_weight.zero_();
    return {grad_x, grad_weight};
  }
  // Any layout is accepted; a non-contiguous one is copied once.
  const at::Tensor x_in = x.contiguous();
  const at::Tensor g_in = grad_y.contiguous();
  std::vector<float> w_widened;
  const at::Tensor w_in = weight.contiguous();
  const float* w = widen_to_float(w_in, w_widened, static_cast<float>(offset));
  const RowChunks chunks = plan_chunks(rows, rows_per_task);
  std::vector<float> partials(chunks.count * hidden, 0.f);
  const float eps_f = static_cast<float>(eps);
  const at::Tensor rstd_in = rstd == nullptr ? at::Tensor() : rstd->contiguous();
  const float* rstd_ptr = rstd == nullptr ? nullptr : rstd_in.const_data_ptr<float>();
  AT_DISPATCH_V2(x.scalar_type(), "rms_norm_cpu_backward_fused", AT_WRAP([&] {
    const scalar_t* x_ptr = x_in.const_data_ptr<scalar_t>();
    const scalar_t* g_ptr = g_in.const_data_ptr<scalar_t>();
    scalar_t* dx_ptr = grad_x.mutable_data_ptr<scalar_t>();
    for_each_chunk(chunks, rows, [&](int64_t chunk, int64_t begin, int64_t end) {
      float* dw = partials.data() + chunk * hidden;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t at = r * hidden;
        if (rstd_ptr != nullptr) {
          rms_norm_backward_row<true>(g_ptr + at, x_ptr + at, w, dx_ptr + at, dw, hidden, eps_f,
                                      rstd_ptr[r]);
        } else {
          rms_norm_backward_row<false>(g_ptr + at, x_ptr + at, w, dx_ptr + at, dw, hidden, eps_f,
                                       0.f);
        }
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  reduce_partials(partials, chunks.count, hidden, grad_weight);
  return {grad_x, grad_weight};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu_backward_fused(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, double eps,
    double offset, int64_t rows_per_task) {
  check_backward_args(grad_y, x, weight, rows_per_task, "fusionlab::rms_norm_cpu_backward_fused");
  return rms_norm_backward(grad_y, x, weight, eps, offset, rows_per_task, nullptr);
}

// The fused backward reading each row's r from `rstd` (rms_norm_cpu_stats's second output).
std::tuple<at::Tensor, at::Tensor> rms_norm_cpu_backward_saved(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& rstd, double offset, int64_t rows_per_task) {
  constexpr const char* kOp = "fusionlab::rms_norm_cpu_backward_saved";
  check_backward_args(grad_y, x, weight, rows_per_task, kOp);
  TORCH_CHECK(rstd.device().is_cpu() && rstd.scalar_type() == at::kFloat &&
                  rstd.sizes() == x.sizes().slice(0, x.dim() - 1),
              kOp, ": rstd must be float32 of x's shape without its last dim, got ",
              rstd.scalar_type(), " ", rstd.sizes());
  return rms_norm_backward(grad_y, x, weight, 0.0, offset, rows_per_task, &rstd);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t,
                                    c10::string_view, double, c10::string_view);

// rms_norm_cpu itself (rmsnorm_cpu.cpp, loaded first by kernels/rmsnorm/cpu_backward.py).
const auto& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusionlab::rms_norm_cpu", "")
                             .typed<ForwardSignature>();
  return op;
}

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
    static const auto backward_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("fusionlab::rms_norm_cpu_backward_fused", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, double, double,
                                                      int64_t)>();
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
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  if (!needs_grad(x, weight)) {
    return forward_op().redispatch(below, x, weight, eps, rows_per_task, casting, offset, store);
  }
  return RMSNormFusedGradFunction::apply(x, weight, eps, rows_per_task, std::string(casting),
                                         offset, std::string(store), below);
}

using StatsSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, double, int64_t, c10::string_view, double,
    c10::string_view);

// rms_norm_cpu_stats (rmsnorm_cpu.cpp): y and each row's r, which the backward reads.
const auto& stats_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusionlab::rms_norm_cpu_stats", "")
                             .typed<StatsSignature>();
  return op;
}

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
    static const auto backward_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("fusionlab::rms_norm_cpu_backward_saved", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const at::Tensor&,
                                                      double, int64_t)>();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight] = backward_op.call(
        grads[0], saved[0], saved[1], saved[2], ctx->saved_data["offset"].toDouble(),
        ctx->saved_data["rows_per_task"].toInt());
    return {grad_x, grad_weight, {}, {}, {}, {}, {}, {}};
  }
};

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu_stats_autograd(
    c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& weight, double eps,
    int64_t rows_per_task, c10::string_view casting, double offset, c10::string_view store) {
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  if (!needs_grad(x, weight)) {
    return stats_op().redispatch(below, x, weight, eps, rows_per_task, casting, offset, store);
  }
  const variable_list out = RMSNormSavedStatsFunction::apply(
      x, weight, eps, rows_per_task, std::string(casting), offset, std::string(store), below);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  m.def("rms_norm_cpu_backward_fused(Tensor grad_y, Tensor x, Tensor weight, float eps, "
        "float offset, int rows_per_task) -> (Tensor, Tensor)");
  m.def("rms_norm_cpu_backward_saved(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd, "
        "float offset, int rows_per_task) -> (Tensor, Tensor)");
  m.def("rms_norm_cpu_fused_grad(Tensor x, Tensor weight, float eps, int rows_per_task, "
        "str casting=\"none\", float offset=0.0, str store=\"auto\") -> Tensor");
}

TORCH_LIBRARY_IMPL(fusionlab, CPU, m) {
  m.impl("rms_norm_cpu_backward_fused", &rms_norm_cpu_backward_fused);
  m.impl("rms_norm_cpu_backward_saved", &rms_norm_cpu_backward_saved);
  m.impl("rms_norm_cpu_fused_grad", &rms_norm_cpu_fused_grad);
}

TORCH_LIBRARY_IMPL(fusionlab, Autograd, m) {
  m.impl("rms_norm_cpu_fused_grad", &rms_norm_cpu_fused_grad_autograd);
  m.impl("rms_norm_cpu_stats", &rms_norm_cpu_stats_autograd);
}
