// Residual add fused with LayerNorm for CPU: s = x + residual, formed in fp32;
// res = s stored in x's dtype; out = (s - mean) * rsqrt(var + eps) * weight + bias, the
// statistics taken from the fp32 sum (biased variance), as add_rmsnorm takes its from the fp32 sum.
// Two passes per row: one read of x and residual for the mean and variance of their sum (Welford's
// or shifted sums, `stats`: ../../layernorm/csrc/welford_moments.h), then a second read that the
// cache serves, writing both results; `row_group` rows at a time share each weight and bias load.
// `store` picks plain or non-temporal stores (StoreKind). Out of place only.
// Shared helpers are in ../../rmsnorm/csrc/cpu_norm_common.h.

#include "cpu_norm_common.h"
#include "norm_args.h"
#include "op_kernels.h"
#include "static_flags.h"
#include "welford_moments.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <tuple>

namespace {

using namespace fusionlab_cpu;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

struct Rows {
  int64_t rows, hidden, x_stride, r_stride;
};

// kGroup rows of x and residual (g.x_stride and g.r_stride apart), normalised together: the
// statistics of each row's sum, then one sweep over the columns that loads each block of weight
// and bias once for all kGroup rows. x_next and r_next are the first rows of the group processed
// after this one (or these): prefetched meanwhile.
template <bool kStream, Stats kStats, int kGroup, typename T>
void add_layer_norm_group(const T* x, const T* r, const T* x_next, const T* r_next,
                          const float* w, const float* b, T* out, T* res, const Rows& g,
                          float eps) {
  const int64_t n = g.hidden;
  float mean[kGroup], rstd[kGroup];
  fVec vmean[kGroup], vrstd[kGroup];
  for (int k = 0; k < kGroup; ++k) {
    const SumOf<T> sum{x + k * g.x_stride, r + k * g.r_stride};
    const Moments moments = moments_of<kStats>(sum, n);
    mean[k] = static_cast<float>(moments.mean);
    rstd[k] = static_cast<float>(1.0 / std::sqrt(moments.m2 / moments.count + eps));
    vmean[k] = fVec(mean[k]), vrstd[k] = fVec(rstd[k]);
  }
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const fVec w_lo = fVec::loadu(w + i), w_hi = fVec::loadu(w + i + fVec::size());
    const fVec b_lo = fVec::loadu(b + i), b_hi = fVec::loadu(b + i + fVec::size());
    for (int k = 0; k < kGroup; ++k) {
      prefetch_block(x_next + k * g.x_stride + i);
      prefetch_block(r_next + k * g.r_stride + i);
      fVec lo, hi;
      SumOf<T>{x + k * g.x_stride, r + k * g.r_stride}.block(i, lo, hi);
      store_block<kStream>(res + k * n + i, lo, hi);
      // (s - mean) first: exact when s is near the mean, where s*rstd - mean*rstd would cancel.
      store_block<kStream>(out + k * n + i,
                           at::vec::fmadd((lo - vmean[k]) * vrstd[k], w_lo, b_lo),
                           at::vec::fmadd((hi - vmean[k]) * vrstd[k], w_hi, b_hi));
    }
  }
  for (int k = 0; k < kGroup; ++k) {
    const SumOf<T> sum{x + k * g.x_stride, r + k * g.r_stride};
    for (int64_t j = i; j < n; ++j) {
      const float s = sum.at(j);
      res[k * n + j] = static_cast<T>(s);
      out[k * n + j] = static_cast<T>((s - mean[k]) * rstd[k] * w[j] + b[j]);
    }
  }
}

// rows_per_task is parallel_for's grain: the fewest rows a task gets, so small inputs wake fewer
// threads (none for rows <= rows_per_task). Each task takes its rows kGroup at a time, and any
// left over one by one.
template <bool kStream, Stats kStats, int kGroup, typename T>
void add_layer_norm_rows(const T* x, const T* r, const float* w, const float* b, T* out, T* res,
                         const Rows& g, float eps, int64_t rows_per_task) {
  at::parallel_for(0, g.rows, rows_per_task, [&](int64_t begin, int64_t end) {
    int64_t row = begin;
    for (; row < end; row += kGroup) {
      const bool whole = row + kGroup <= end;
      const T* x_row = x + row * g.x_stride;
      const T* r_row = r + row * g.r_stride;
      T* out_row = out + row * g.hidden;
      T* res_row = res + row * g.hidden;
      if (!whole) {  // the leftover rows, one at a time
        for (; row < end; ++row, x_row += g.x_stride, r_row += g.r_stride,
                          out_row += g.hidden, res_row += g.hidden) {
          add_layer_norm_group<kStream, kStats, 1>(x_row, r_row, x_row, r_row, w, b, out_row,
                                                   res_row, g, eps);
        }
        break;
      }
      const bool last = row + 2 * kGroup > end;
      add_layer_norm_group<kStream, kStats, kGroup>(
          x_row, r_row, last ? x_row : x_row + kGroup * g.x_stride,
          last ? r_row : r_row + kGroup * g.r_stride, w, b, out_row, res_row, g, eps);
    }
    if constexpr (kStream) {
      stream_fence();
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_cpu(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
    const at::Tensor& bias, double eps, int64_t rows_per_task, c10::string_view store,
    c10::string_view stats, int64_t row_group) {
  const char* op = "fusionlab::add_layer_norm_cpu";
  check_forward_args(op, {x, &residual, weight, &bias}, eps, rows_per_task);
  const StoreKind store_kind = parse_store(store, op);
  const Stats stats_kind = parse_stats(stats, op);
  check_row_group(row_group, op);
  at::Tensor out = empty_cpu_like(x), res = empty_cpu_like(x);
  if (x.numel() == 0) {
    return {out, res};
  }
  const int64_t hidden = x.size(-1);
  const StridedRows x_src = strided_rows(x), r_src = strided_rows(residual);
  const Rows g{x.numel() / hidden, hidden, x_src.stride, r_src.stride};

  const Fp32Param w_param(weight), b_param(bias);
  const float* w = w_param.data();
  const float* b = b_param.data();
  const float eps_f = static_cast<float>(eps);
  const bool stream = streams(out, store_kind) && streams(res, store_kind);
  AT_DISPATCH_V2(x.scalar_type(), "add_layer_norm_cpu", AT_WRAP([&] {
    with_flags([&](auto streamed, auto shifted, auto grouped) {
      constexpr Stats kStats = shifted ? Stats::kShifted : Stats::kWelford;
      add_layer_norm_rows<streamed, kStats, grouped ? kRowGroup : 1>(
          x_src.tensor.const_data_ptr<scalar_t>(), r_src.tensor.const_data_ptr<scalar_t>(), w, b,
          out.mutable_data_ptr<scalar_t>(), res.mutable_data_ptr<scalar_t>(), g, eps_f,
          rows_per_task);
    }, stream, stats_kind == Stats::kShifted, row_group == kRowGroup);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {out, res};
}

using Pair = std::tuple<at::Tensor, at::Tensor>;

constexpr auto forward_op =
    op_handle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   double, int64_t, c10::string_view, c10::string_view, int64_t),
              "fusionlab::add_layer_norm_cpu">;

class AddLayerNormFunction : public torch::autograd::Function<AddLayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& residual, const at::Tensor& weight,
                               const at::Tensor& bias, double eps, int64_t rows_per_task,
                               const std::string& store, const std::string& stats,
                               int64_t row_group, c10::DispatchKeySet below) {
    ctx->save_for_backward({x, residual, weight, bias});
    ctx->saved_data["eps"] = eps;
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, res] = forward_op().redispatch(below, x, residual, weight, bias, eps,
                                              rows_per_task, store, stats, row_group);
    return {out, res};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // kernels/norm_grads.py registers it; it returns dL/dsum (= dL/dx = dL/dresidual), dL/dw,
    // dL/db.
    const auto& backward_op =
        op_handle<Triple(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, double),
                  "fusionlab::add_layer_norm_backward">();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_total, grad_weight, grad_bias] =
        backward_op.call(grads[0], grads[1], saved[0], saved[1], saved[2], saved[3],
                         ctx->saved_data["eps"].toDouble());
    return {grad_total, grad_total, grad_weight, grad_bias, {}, {}, {}, {}, {}, {}};
  }
};

// The Autograd kernel, in C++ so that a call that needs no gradient pays no Python.
Pair add_layer_norm_cpu_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                 const at::Tensor& residual, const at::Tensor& weight,
                                 const at::Tensor& bias, double eps, int64_t rows_per_task,
                                 c10::string_view store, c10::string_view stats,
                                 int64_t row_group) {
  return redispatch_or_record<AddLayerNormFunction>(
      keys, forward_op(), needs_grad(x, residual, weight, bias), x, residual, weight, bias, eps,
      rows_per_task, store, stats, row_group);
}

}  // namespace

// FRAGMENT, so other fusionlab extensions can add ops to the same namespace in one process.
TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  def_cpu_autograd(m,
                   "add_layer_norm_cpu(Tensor x, Tensor residual, Tensor weight, Tensor bias, "
                   "float eps, int rows_per_task, str store=\"auto\", str stats=\"welford\", "
                   "int row_group=1) -> (Tensor, Tensor)",
                   &add_layer_norm_cpu, &add_layer_norm_cpu_autograd);
}
