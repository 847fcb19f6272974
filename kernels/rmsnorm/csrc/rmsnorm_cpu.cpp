// RMSNorm over the last dim for CPU: y = x * rsqrt(mean(x^2) + eps) * weight.
// Two passes per row (sum of squares, then scaled write; or one read into an fp32 row buffer, see
// Passes), all arithmetic in fp32, one rounding on store; with casting "llama" the normalised row
// is also rounded to x's dtype before the weight multiply (HF LlamaRMSNorm), and `offset` is
// added to the weight (Gemma's 1 + weight); `store` picks plain or non-temporal stores (see
// StoreKind). Shared helpers (loads, stores, streaming, strides) are in cpu_norm_common.h.

#include "cpu_norm_common.h"
#include "norm_args.h"
#include "op_kernels.h"
#include "static_flags.h"
#include "torch_order_sum.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <tuple>

namespace {

using namespace fusionlab_cpu;
using Pair = std::tuple<at::Tensor, at::Tensor>;

// x (of type S: T, or the fp32 row buffer of a one-pass task) is read twice; x_next is the row
// processed after this one (or x itself): it is prefetched during pass 2.
// kTorchOrder sums the squares as ATen does (torch_order_sum.h), for a module's own numerics.
// rstd, when not null, receives the row's 1 / rms (rms_norm_cpu_stats saves it for backward).
template <bool kStream, bool kRoundNormed, bool kTorchOrder, typename S, typename T>
void rms_norm_row(const S* x, const T* x_next, const float* w, T* y, int64_t n, float eps,
                  float* rstd) {
  float sum_sq;
  if constexpr (kTorchOrder) {
    sum_sq = torch_order_sum_sq(x, n);
  } else {
    sum_sq = fast_sum_sq(x, n);
  }
  const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  if (rstd != nullptr) {
    *rstd = inv_rms;
  }
  const fVec vinv(inv_rms);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    prefetch_block(x_next + i);
    fVec a, b;
    load_block(x + i, a, b);
    const fVec w_lo = fVec::loadu(w + i);
    const fVec w_hi = fVec::loadu(w + i + fVec::size());
    fVec normed_lo = a * vinv, normed_hi = b * vinv;
    if constexpr (kRoundNormed) {
      round_block<T>(normed_lo, normed_hi);
    }
    store_block<kStream>(y + i, normed_lo * w_lo, normed_hi * w_hi);
  }
  for (; i < n; ++i) {
    float normed = static_cast<float>(x[i]) * inv_rms;
    if constexpr (kRoundNormed) {
      normed = round_scalar<T>(normed);
    }
    y[i] = static_cast<T>(normed * w[i]);
  }
}

// grain is parallel_for's: the fewest rows a task gets, so small inputs wake fewer threads (none
// for rows <= grain). kOnePass: each row is widened once into the task's fp32 buffer (Passes).
// rstd: one float per row, or null.
template <bool kStream, bool kRoundNormed, bool kTorchOrder, bool kOnePass, typename T>
void rms_norm_rows(const T* x, int64_t x_row_stride, const float* w, T* y, int64_t rows,
                   int64_t hidden, float eps, int64_t grain, float* rstd) {
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(kOnePass ? hidden : 0);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * x_row_stride;
      const T* next = r + 1 < end ? row + x_row_stride : row;
      float* row_rstd = rstd == nullptr ? nullptr : rstd + r;
      if constexpr (kOnePass) {
        widen_row(row, buffer.data(), hidden);
        rms_norm_row<kStream, kRoundNormed, kTorchOrder>(buffer.data(), next, w, y + r * hidden,
                                                         hidden, eps, row_rstd);
      } else {
        rms_norm_row<kStream, kRoundNormed, kTorchOrder>(row, next, w, y + r * hidden, hidden,
                                                         eps, row_rstd);
      }
    }
    if constexpr (kStream) {
      stream_fence();
    }
  });
}

// The body of rms_norm_cpu and rms_norm_cpu_stats: checks the arguments and writes y (allocated
// here) and, when `rstd` is defined (fp32, one per row), each row's 1 / rms.
at::Tensor rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps,
                         int64_t rows_per_task, c10::string_view casting, double offset,
                         c10::string_view store, c10::string_view passes, int64_t task_bytes,
                         at::Tensor* rstd) {
  const bool round_normed = rounds_normed(casting, "fusionlab::rms_norm_cpu");
  const StoreKind store_kind = parse_store(store, "fusionlab::rms_norm_cpu");
  const Passes passes_kind = parse_passes(passes, "fusionlab::rms_norm_cpu");
  check_task_bytes(task_bytes, "fusionlab::rms_norm_cpu");
  check_forward_args("fusionlab::rms_norm_cpu", {x, nullptr, weight, nullptr}, eps,
                     rows_per_task);
  const int64_t hidden = x.size(-1);

  at::Tensor y = empty_cpu_like(x);
  if (rstd != nullptr) {
    *rstd = at::detail::empty_cpu(x.sizes().slice(0, x.dim() - 1), at::kFloat);
  }
  if (y.numel() == 0) {
    return y;
  }
  const int64_t rows = x.numel() / hidden;
  float* rstd_ptr = rstd == nullptr ? nullptr : rstd->mutable_data_ptr<float>();

  const StridedRows src = strided_rows(x);

  const Fp32Param w_param(weight, static_cast<float>(offset));
  const float* w = w_param.data();

  const float eps_f = static_cast<float>(eps);
  const int64_t grain = grain_rows(rows_per_task, task_bytes, hidden * x.element_size());
  AT_DISPATCH_V2(x.scalar_type(), "rms_norm_cpu", AT_WRAP([&] {
    // Casting "none" sums fast; a module's numerics ("llama", "gemma") also mean its order of
    // summing (round_normed, "llama", implies it).
    with_flags([&](auto streamed, auto rounded, auto torch_order, auto one_pass) {
      rms_norm_rows<streamed, rounded, torch_order || rounded, one_pass>(
          src.tensor.const_data_ptr<scalar_t>(), src.stride, w, y.mutable_data_ptr<scalar_t>(),
          rows, hidden, eps_f, grain, rstd_ptr);
    }, streams(y, store_kind), round_normed, casting != "none", passes_kind == Passes::kOne);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return y;
}

at::Tensor rms_norm_cpu_paths(const at::Tensor& x, const at::Tensor& weight, double eps,
                              int64_t rows_per_task, c10::string_view casting, double offset,
                              c10::string_view store, c10::string_view passes,
                              int64_t task_bytes) {
  return rms_norm_into(x, weight, eps, rows_per_task, casting, offset, store, passes, task_bytes,
                       nullptr);
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps,
                        int64_t rows_per_task, c10::string_view casting, double offset,
                        c10::string_view store) {
  return rms_norm_cpu_paths(x, weight, eps, rows_per_task, casting, offset, store, "two", 0);
}

// rms_norm_cpu's y (the same code path, bit for bit) and each row's 1 / rms in fp32, shaped as
// x without its last dim: what the fused-saved backward reads instead of recomputing it.
std::tuple<at::Tensor, at::Tensor> rms_norm_cpu_stats(
    const at::Tensor& x, const at::Tensor& weight, double eps, int64_t rows_per_task,
    c10::string_view casting, double offset, c10::string_view store) {
  at::Tensor rstd;
  at::Tensor y =
      rms_norm_into(x, weight, eps, rows_per_task, casting, offset, store, "two", 0, &rstd);
  return {y, rstd};
}

// The op as typed handles: the forward with every path argument (rms_norm_cpu.paths, which both
// overloads redispatch to below autograd) and its backward, which kernels/norm_grads.py registers.
constexpr auto forward_op =
    op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t, c10::string_view,
                         double, c10::string_view, c10::string_view, int64_t),
              "fusionlab::rms_norm_cpu", "paths">;

class RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, int64_t rows_per_task, const std::string& casting,
                            double offset, const std::string& store,
                            const std::string& passes, int64_t task_bytes,
                            c10::DispatchKeySet below) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().redispatch(below, x, weight, eps, rows_per_task, casting, offset,
                                   store, passes, task_bytes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& backward_op =
        op_handle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double),
                  "fusionlab::rms_norm_backward">();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight] =
        backward_op.call(grads[0], saved[0], saved[1], ctx->saved_data["eps"].toDouble(),
                         ctx->saved_data["offset"].toDouble());
    return {grad_x, grad_weight, {}, {}, {}, {}, {}, {}, {}, {}};
  }
};

// The Autograd kernels, in C++ so that a call that needs no gradient pays no Python.
at::Tensor rms_norm_cpu_paths_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                       const at::Tensor& weight, double eps,
                                       int64_t rows_per_task, c10::string_view casting,
                                       double offset, c10::string_view store,
                                       c10::string_view passes, int64_t task_bytes) {
  return redispatch_or_record<RMSNormFunction>(keys, forward_op(), needs_grad(x, weight), x,
                                               weight, eps, rows_per_task, casting, offset, store,
                                               passes, task_bytes);
}

at::Tensor rms_norm_cpu_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                 const at::Tensor& weight, double eps, int64_t rows_per_task,
                                 c10::string_view casting, double offset,
                                 c10::string_view store) {
  return rms_norm_cpu_paths_autograd(keys, x, weight, eps, rows_per_task, casting, offset, store,
                                     "two", 0);
}

}  // namespace

// FRAGMENT, so other fusionlab extensions can add ops to the same namespace in one process.
TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  def_cpu_autograd(m,
                   "rms_norm_cpu(Tensor x, Tensor weight, float eps, int rows_per_task, "
                   "str casting=\"none\", float offset=0.0, str store=\"auto\") -> Tensor",
                   &rms_norm_cpu, &rms_norm_cpu_autograd);
  // The same op with the path choices (Passes, grain_rows in cpu_norm_common.h).
  def_cpu_autograd(m,
                   "rms_norm_cpu.paths(Tensor x, Tensor weight, float eps, int rows_per_task, "
                   "str casting=\"none\", float offset=0.0, str store=\"auto\", "
                   "str passes=\"two\", int task_bytes=0) -> Tensor",
                   &rms_norm_cpu_paths, &rms_norm_cpu_paths_autograd);
  def_cpu(m,
          "rms_norm_cpu_stats(Tensor x, Tensor weight, float eps, int rows_per_task, "
          "str casting=\"none\", float offset=0.0, str store=\"auto\") -> (Tensor, Tensor)",
          &rms_norm_cpu_stats);
}
