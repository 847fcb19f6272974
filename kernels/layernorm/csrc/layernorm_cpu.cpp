// LayerNorm over the last dim for CPU: y = (x - mean) * rsqrt(var + eps) * weight + bias, with the
// biased (population) variance. Two passes per row: one read of x for mean and variance
// (welford_moments.h: Welford's, or with `stats="shifted"` shifted sums), then the normalised
// write, which finds the row still in L1/L2; `row_group` rows at a time share each weight and bias
// load. All arithmetic in fp32 (row statistics merged in fp64), one rounding on store; `store`
// picks plain or non-temporal stores (StoreKind). Shared helpers are in ../../rmsnorm/csrc.

#include "cpu_norm_common.h"
#include "norm_args.h"
#include "op_kernels.h"
#include "static_flags.h"
#include "welford_moments.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <tuple>

namespace {

using namespace fusionlab_cpu;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// kGroup rows at x (rows `stride` apart), normalised together: the statistics of each row, then
// one sweep over the columns that loads each block of weight and bias once for all kGroup rows
// (with one row per sweep, those two loads per block of x bound the write). `next` is the first
// row of the group processed after this one (or x itself): its rows are prefetched meanwhile.
// saved_mean and saved_rstd, when not null, receive the kGroup rows' statistics (fp32).
template <bool kStream, Stats kStats, int kGroup, typename T>
void layer_norm_group(const T* x, int64_t stride, const T* next, const float* w, const float* b,
                      T* y, int64_t n, float eps, float* saved_mean, float* saved_rstd) {
  float mean[kGroup], rstd[kGroup];
  fVec vmean[kGroup], vrstd[kGroup];
  for (int k = 0; k < kGroup; ++k) {
    const Moments moments = moments_of<kStats>(RowOf<T>{x + k * stride}, n);
    mean[k] = static_cast<float>(moments.mean);
    rstd[k] = static_cast<float>(1.0 / std::sqrt(moments.m2 / moments.count + eps));
    vmean[k] = fVec(mean[k]), vrstd[k] = fVec(rstd[k]);
    if (saved_mean != nullptr) {
      saved_mean[k] = mean[k];
      saved_rstd[k] = rstd[k];
    }
  }
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const fVec w_lo = fVec::loadu(w + i), w_hi = fVec::loadu(w + i + fVec::size());
    const fVec b_lo = fVec::loadu(b + i), b_hi = fVec::loadu(b + i + fVec::size());
    for (int k = 0; k < kGroup; ++k) {
      prefetch_block(next + k * stride + i);
      fVec lo, hi;
      load_block(x + k * stride + i, lo, hi);
      // (x - mean) first: exact when x is near the mean, where x*rstd - mean*rstd would cancel.
      store_block<kStream>(y + k * n + i, at::vec::fmadd((lo - vmean[k]) * vrstd[k], w_lo, b_lo),
                           at::vec::fmadd((hi - vmean[k]) * vrstd[k], w_hi, b_hi));
    }
  }
  for (int k = 0; k < kGroup; ++k) {
    for (int64_t j = i; j < n; ++j) {
      const float v = static_cast<float>(x[k * stride + j]);
      y[k * n + j] = static_cast<T>((v - mean[k]) * rstd[k] * w[j] + b[j]);
    }
  }
}

// grain is parallel_for's: the fewest rows a task gets, so small inputs wake fewer threads (none
// for rows <= grain; grain_rows in cpu_norm_common.h). Each task takes its rows kGroup at a time,
// and any left over one by one. mean and rstd: one float per row each, or both null.
template <bool kStream, Stats kStats, int kGroup, typename T>
void layer_norm_rows(const T* x, int64_t x_row_stride, const float* w, const float* b, T* y,
                     int64_t rows, int64_t hidden, float eps, int64_t grain, float* mean,
                     float* rstd) {
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const auto at_row = [](float* stats, int64_t r) {
      return stats == nullptr ? nullptr : stats + r;
    };
    int64_t r = begin;
    for (; r + kGroup <= end; r += kGroup) {
      const T* group = x + r * x_row_stride;
      const T* next = r + 2 * kGroup <= end ? group + kGroup * x_row_stride : group;
      layer_norm_group<kStream, kStats, kGroup>(group, x_row_stride, next, w, b, y + r * hidden,
                                                hidden, eps, at_row(mean, r), at_row(rstd, r));
    }
    for (; r < end; ++r) {
      const T* row = x + r * x_row_stride;
      layer_norm_group<kStream, kStats, 1>(row, x_row_stride, row, w, b, y + r * hidden, hidden,
                                           eps, at_row(mean, r), at_row(rstd, r));
    }
    if constexpr (kStream) {
      stream_fence();
    }
  });
}

// The body of layer_norm_cpu and layer_norm_cpu_stats: checks the arguments and writes y
// (allocated here) and, when `mean` and `rstd` are given, each row's statistics (fp32).
at::Tensor layer_norm_into(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           double eps, int64_t rows_per_task, c10::string_view store,
                           c10::string_view stats, int64_t row_group, int64_t task_bytes,
                           at::Tensor* mean, at::Tensor* rstd) {
  const StoreKind store_kind = parse_store(store, "fusionlab::layer_norm_cpu");
  check_task_bytes(task_bytes, "fusionlab::layer_norm_cpu");
  const Stats stats_kind = parse_stats(stats, "fusionlab::layer_norm_cpu");
  check_row_group(row_group, "fusionlab::layer_norm_cpu");
  check_forward_args("fusionlab::layer_norm_cpu", {x, nullptr, weight, &bias}, eps,
                     rows_per_task);
  const int64_t hidden = x.size(-1);

  at::Tensor y = empty_cpu_like(x);
  const bool save_stats = mean != nullptr;
  if (save_stats) {
    *mean = at::detail::empty_cpu(x.sizes().slice(0, x.dim() - 1), at::kFloat);
    *rstd = at::detail::empty_cpu(x.sizes().slice(0, x.dim() - 1), at::kFloat);
  }
  if (y.numel() == 0) {
    return y;
  }
  const int64_t rows = x.numel() / hidden;
  float* mean_ptr = save_stats ? mean->mutable_data_ptr<float>() : nullptr;
  float* rstd_ptr = save_stats ? rstd->mutable_data_ptr<float>() : nullptr;
  const StridedRows src = strided_rows(x);

  const Fp32Param w_param(weight), b_param(bias);
  const float* w = w_param.data();
  const float* b = b_param.data();

  const float eps_f = static_cast<float>(eps);
  const int64_t grain = grain_rows(rows_per_task, task_bytes, hidden * x.element_size());
  AT_DISPATCH_V2(x.scalar_type(), "layer_norm_cpu", AT_WRAP([&] {
    with_flags([&](auto streamed, auto shifted, auto grouped) {
      constexpr Stats kStats = shifted ? Stats::kShifted : Stats::kWelford;
      layer_norm_rows<streamed, kStats, grouped ? kRowGroup : 1>(
          src.tensor.const_data_ptr<scalar_t>(), src.stride, w, b, y.mutable_data_ptr<scalar_t>(),
          rows, hidden, eps_f, grain, mean_ptr, rstd_ptr);
    }, streams(y, store_kind), stats_kind == Stats::kShifted, row_group == kRowGroup);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return y;
}

at::Tensor layer_norm_cpu_paths(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, double eps, int64_t rows_per_task,
                                c10::string_view store, c10::string_view stats,
                                int64_t row_group, int64_t task_bytes) {
  return layer_norm_into(x, weight, bias, eps, rows_per_task, store, stats, row_group,
                         task_bytes, nullptr, nullptr);
}

at::Tensor layer_norm_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          double eps, int64_t rows_per_task, c10::string_view store,
                          c10::string_view stats, int64_t row_group) {
  return layer_norm_cpu_paths(x, weight, bias, eps, rows_per_task, store, stats, row_group, 0);
}

// layer_norm_cpu's y (the same code path, bit for bit) and each row's mean and rstd in fp32,
// shaped as x without its last dim: what the fused-saved backward reads instead of recomputing.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cpu_stats(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    int64_t rows_per_task, c10::string_view store, c10::string_view stats, int64_t row_group) {
  at::Tensor mean, rstd;
  at::Tensor y = layer_norm_into(x, weight, bias, eps, rows_per_task, store, stats, row_group,
                                 0, &mean, &rstd);
  return {y, mean, rstd};
}

// layer_norm_cpu.paths, which both overloads redispatch to below autograd.
constexpr auto forward_op =
    op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                         c10::string_view, c10::string_view, int64_t, int64_t),
              "fusionlab::layer_norm_cpu", "paths">;

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, double eps, int64_t rows_per_task,
                            const std::string& store, const std::string& stats,
                            int64_t row_group, int64_t task_bytes,
                            c10::DispatchKeySet below) {
    ctx->save_for_backward({x, weight, bias});
    ctx->saved_data["eps"] = eps;
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().redispatch(below, x, weight, bias, eps, rows_per_task, store, stats,
                                   row_group, task_bytes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Registered by kernels/norm_grads.py.
    const auto& backward_op =
        op_handle<Triple(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         double),
                  "fusionlab::layer_norm_backward">();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight, grad_bias] = backward_op.call(
        grads[0], saved[0], saved[1], saved[2], ctx->saved_data["eps"].toDouble());
    return {grad_x, grad_weight, grad_bias, {}, {}, {}, {}, {}, {}, {}};
  }
};

// The Autograd kernels, in C++ so that a call that needs no gradient pays no Python.
at::Tensor layer_norm_cpu_paths_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                         const at::Tensor& weight, const at::Tensor& bias,
                                         double eps, int64_t rows_per_task,
                                         c10::string_view store, c10::string_view stats,
                                         int64_t row_group, int64_t task_bytes) {
  return redispatch_or_record<LayerNormFunction>(keys, forward_op(), needs_grad(x, weight, bias),
                                                 x, weight, bias, eps, rows_per_task, store,
                                                 stats, row_group, task_bytes);
}

at::Tensor layer_norm_cpu_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                   const at::Tensor& weight, const at::Tensor& bias, double eps,
                                   int64_t rows_per_task, c10::string_view store,
                                   c10::string_view stats, int64_t row_group) {
  return layer_norm_cpu_paths_autograd(keys, x, weight, bias, eps, rows_per_task, store, stats,
                                       row_group, 0);
}

}  // namespace

// FRAGMENT, so other fusionlab extensions can add ops to the same namespace in one process.
TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  def_cpu_autograd(m,
                   "layer_norm_cpu(Tensor x, Tensor weight, Tensor bias, float eps, "
                   "int rows_per_task, str store=\"auto\", str stats=\"welford\", "
                   "int row_group=1) -> Tensor",
                   &layer_norm_cpu, &layer_norm_cpu_autograd);
  // The same op with a parallel grain by bytes too (grain_rows in cpu_norm_common.h).
  def_cpu_autograd(m,
                   "layer_norm_cpu.paths(Tensor x, Tensor weight, Tensor bias, float eps, "
                   "int rows_per_task, str store=\"auto\", str stats=\"welford\", "
                   "int row_group=1, int task_bytes=0) -> Tensor",
                   &layer_norm_cpu_paths, &layer_norm_cpu_paths_autograd);
  def_cpu(m,
          "layer_norm_cpu_stats(Tensor x, Tensor weight, Tensor bias, float eps, "
          "int rows_per_task, str store=\"auto\", str stats=\"welford\", int row_group=1) "
          "-> (Tensor, Tensor, Tensor)",
          &layer_norm_cpu_stats);
}
