// Residual add fused with RMSNorm for CPU: s = x + residual (in fp32), residual_out = s stored
// in x's dtype, out = s * rsqrt(mean(s^2) + eps) * weight.
// Two passes per row (or one, `passes`: see add_rms_norm_row_one_pass). Pass 1 reads x and
// residual (the only DRAM read) and accumulates sum(s^2) in fp32. Pass 2 re-reads both from
// L1/L2, forms s again (bit-identical), and writes residual_out and out: out is thus computed from
// the fp32 sum, as vLLM's fused_add_rms_norm computes its variance, and neither output has to be
// re-read, so both can be written with non-temporal stores when they are big (writing
// residual_out in pass 1 instead would keep it out of streaming, since pass 2 would then have to
// read it back).
// The in-place flavour (vLLM's contract) writes out into x and s into residual: each block is
// read before it is written, so the same two passes are safe in place. The out-of-place op's
// `store` picks plain or non-temporal stores (StoreKind); in place, stores are always plain.
// Casting "llama" and "gemma" (fusionlab/numerics.py) model a decoder layer whose add is its own
// op: the sum is rounded to x's dtype before its statistics are taken (kRoundSum), as the model's
// `residual + hidden_states` is; "llama" also rounds the normalised row before the weight multiply.
// Shared helpers are in ../../rmsnorm/csrc/cpu_norm_common.h.

#include "cpu_norm_common.h"
#include "norm_args.h"
#include "op_kernels.h"
#include "static_flags.h"
#include "torch_order_sum.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <tuple>

namespace {

using namespace fusionlab_cpu;

struct Rows {
  int64_t rows, hidden;
  int64_t x_stride, r_stride, out_stride, res_stride;
};

struct Casting {
  bool round_sum, round_normed;
};

Casting parse_casting(c10::string_view casting, const char* op) {
  const bool round_normed = rounds_normed(casting, op);
  return {casting != "none", round_normed};
}

template <bool kRoundSum, typename T>
inline void add_block(fVec& a, fVec& b, const fVec& ra, const fVec& rb) {
  a = a + ra, b = b + rb;
  if constexpr (kRoundSum) {
    round_block<T>(a, b);
  }
}

template <bool kRoundSum, typename T>
inline float add_scalar(T x, T r) {
  const float s = static_cast<float>(x) + static_cast<float>(r);
  return kRoundSum ? round_scalar<T>(s) : s;
}

// Stores one block of the sum s (as residual_out) and of the normalised output.
template <bool kStream, bool kRoundNormed, typename T>
inline void write_block(const fVec& sa, const fVec& sb, const fVec& vinv, const float* w, T* out,
                        T* res) {
  store_block<kStream>(res, sa, sb);
  fVec normed_a = sa * vinv, normed_b = sb * vinv;
  if constexpr (kRoundNormed) {
    round_block<T>(normed_a, normed_b);
  }
  store_block<kStream>(out, normed_a * fVec::loadu(w), normed_b * fVec::loadu(w + fVec::size()));
}

template <bool kRoundNormed, typename T>
inline void write_scalar(float s, float inv_rms, float w, T* out, T* res) {
  *res = static_cast<T>(s);
  const float normed = s * inv_rms;
  *out = static_cast<T>((kRoundNormed ? round_scalar<T>(normed) : normed) * w);
}

// With a module's numerics (kRoundSum: "llama", "gemma") the sum is rounded as the module's own
// add rounds it, into `scratch` (n elements), and its squares are summed in ATen's order
// (torch_order_sum.h), so the statistic is the module's bit for bit.
template <bool kStream, bool kRoundSum, bool kRoundNormed, typename T>
void add_rms_norm_row(const T* x, const T* r, const T* x_next, const T* r_next, const float* w,
                      T* out, T* res, T* scratch, int64_t n, float eps) {
  float sum_sq;
  if constexpr (kRoundSum) {
    for (int64_t e = 0; e < n; ++e) {
      scratch[e] = static_cast<T>(add_scalar<true>(x[e], r[e]));
    }
    sum_sq = torch_order_sum_sq(scratch, n);
  } else {
    sum_sq = fast_sum_sq_of(SumOf<T>{x, r}, n);
  }
  const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  const fVec vinv(inv_rms);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    prefetch_block(x_next + i);
    prefetch_block(r_next + i);
    fVec sa, sb, ra, rb;
    load_block(x + i, sa, sb);
    load_block(r + i, ra, rb);
    add_block<kRoundSum, T>(sa, sb, ra, rb);
    write_block<kStream, kRoundNormed>(sa, sb, vinv, w + i, out + i, res + i);
  }
  for (; i < n; ++i) {
    write_scalar<kRoundNormed>(add_scalar<kRoundSum>(x[i], r[i]), inv_rms, w[i], out + i,
                               res + i);
  }
}

// The one-pass row (Passes): x and residual read once, their sum kept in `sum` (n floats, rounded
// as kRoundSum says), whose squares are then summed in the two-pass row's order; both outputs are
// written from that buffer. Bit for bit add_rms_norm_row's results.
template <bool kStream, bool kRoundSum, bool kRoundNormed, typename T>
void add_rms_norm_row_one_pass(const T* x, const T* r, const T* x_next, const T* r_next,
                               const float* w, T* out, T* res, float* sum, int64_t n, float eps) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fVec sa, sb, ra, rb;
    load_block(x + i, sa, sb);
    load_block(r + i, ra, rb);
    add_block<kRoundSum, T>(sa, sb, ra, rb);
    sa.store(sum + i);
    sb.store(sum + i + fVec::size());
  }
  for (; i < n; ++i) {
    sum[i] = add_scalar<kRoundSum>(x[i], r[i]);
  }
  const float sum_sq = kRoundSum ? torch_order_sum_sq(sum, n) : fast_sum_sq(sum, n);
  const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  const fVec vinv(inv_rms);
  for (i = 0; i + kBlock <= n; i += kBlock) {
    prefetch_block(x_next + i);
    prefetch_block(r_next + i);
    write_block<kStream, kRoundNormed>(fVec::loadu(sum + i), fVec::loadu(sum + i + fVec::size()),
                                       vinv, w + i, out + i, res + i);
  }
  for (; i < n; ++i) {
    write_scalar<kRoundNormed>(sum[i], inv_rms, w[i], out + i, res + i);
  }
}

// grain is parallel_for's: the fewest rows a task gets, so small inputs wake fewer threads (none
// for rows <= grain). Each task's buffer: the rounded sum (kRoundSum, two passes) or the fp32 sum
// (kOnePass) of one row.
template <bool kStream, bool kRoundSum, bool kRoundNormed, bool kOnePass, typename T>
void add_rms_norm_rows(const T* x, const T* r, const float* w, T* out, T* res, const Rows& g,
                       float eps, int64_t grain) {
  at::parallel_for(0, g.rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> scratch(kRoundSum && !kOnePass ? g.hidden : 0);
    std::vector<float> sum(kOnePass ? g.hidden : 0);
    for (int64_t row = begin; row < end; ++row) {
      const T* x_row = x + row * g.x_stride;
      const T* r_row = r + row * g.r_stride;
      const bool last = row + 1 >= end;
      const T* x_next = last ? x_row : x_row + g.x_stride;
      const T* r_next = last ? r_row : r_row + g.r_stride;
      T* out_row = out + row * g.out_stride;
      T* res_row = res + row * g.res_stride;
      if constexpr (kOnePass) {
        add_rms_norm_row_one_pass<kStream, kRoundSum, kRoundNormed>(
            x_row, r_row, x_next, r_next, w, out_row, res_row, sum.data(), g.hidden, eps);
      } else {
        add_rms_norm_row<kStream, kRoundSum, kRoundNormed>(
            x_row, r_row, x_next, r_next, w, out_row, res_row, scratch.data(), g.hidden, eps);
      }
    }
    if constexpr (kStream) {
      stream_fence();
    }
  });
}

// How a call runs: rows_per_task and task_bytes (the grain), store kind, passes.
struct Paths {
  int64_t rows_per_task, task_bytes;
  StoreKind store;
  Passes passes;
};

Paths parse_paths(const char* op, int64_t rows_per_task, c10::string_view store,
                  c10::string_view passes, int64_t task_bytes) {
  check_task_bytes(task_bytes, op);
  return {rows_per_task, task_bytes, parse_store(store, op), parse_passes(passes, op)};
}

// Runs the kernel from x and residual (rows at uniform strides) into out and res.
void run(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, at::Tensor& out,
         at::Tensor& res, const Rows& g, double eps, const Paths& paths, Casting casting,
         double offset) {
  const Fp32Param w_param(weight, static_cast<float>(offset));
  const float* w = w_param.data();
  const float eps_f = static_cast<float>(eps);
  const bool stream = streams(out, paths.store) && streams(res, paths.store);
  const int64_t grain =
      grain_rows(paths.rows_per_task, paths.task_bytes, g.hidden * x.element_size());
  AT_DISPATCH_V2(x.scalar_type(), "add_rms_norm_cpu", AT_WRAP([&] {
    // round_normed ("llama") implies round_sum.
    with_flags([&](auto streamed, auto round_sum, auto round_normed, auto one_pass) {
      add_rms_norm_rows<streamed, round_sum || round_normed, round_normed, one_pass>(
          x.const_data_ptr<scalar_t>(), residual.const_data_ptr<scalar_t>(), w,
          out.mutable_data_ptr<scalar_t>(), res.mutable_data_ptr<scalar_t>(), g, eps_f, grain);
    }, stream, casting.round_sum, casting.round_normed, paths.passes == Passes::kOne);
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu_paths(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
    int64_t rows_per_task, c10::string_view casting, double offset, c10::string_view store,
    c10::string_view passes, int64_t task_bytes) {
  const char* op = "fusionlab::add_rms_norm_cpu";
  check_forward_args(op, {x, &residual, weight, nullptr}, eps, rows_per_task);
  const Casting mode = parse_casting(casting, op);
  const Paths paths = parse_paths(op, rows_per_task, store, passes, task_bytes);
  at::Tensor out = empty_cpu_like(x), res = empty_cpu_like(x);
  if (x.numel() == 0) {
    return {out, res};
  }
  const int64_t hidden = x.size(-1);
  const StridedRows x_src = strided_rows(x), r_src = strided_rows(residual);
  const Rows g{x.numel() / hidden, hidden, x_src.stride, r_src.stride, hidden, hidden};
  run(x_src.tensor, r_src.tensor, weight, out, res, g, eps, paths, mode, offset);
  return {out, res};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x,
                                                    const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps,
                                                    int64_t rows_per_task,
                                                    c10::string_view casting, double offset,
                                                    c10::string_view store) {
  return add_rms_norm_cpu_paths(x, residual, weight, eps, rows_per_task, casting, offset, store,
                                "two", 0);
}

// vLLM's fused_add_rms_norm contract: residual <- x + residual, x <- rmsnorm(new residual).
// It returns nothing: torch.compile can functionalize a mutating custom op only when no output
// aliases an input (the Python wrapper returns x and residual).
void add_rms_norm_cpu_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                       double eps, int64_t rows_per_task, c10::string_view casting,
                       double offset, c10::string_view passes, int64_t task_bytes) {
  const char* op = "fusionlab::add_rms_norm_cpu_";
  check_forward_args(op, {x, &residual, weight, nullptr}, eps, rows_per_task);
  const Casting mode = parse_casting(casting, op);
  // Plain stores: pass 1 has just pulled every line being written into the cache.
  const Paths paths = parse_paths(op, rows_per_task, "plain", passes, task_bytes);
  at::assert_no_internal_overlap(x);
  at::assert_no_internal_overlap(residual);
  at::assert_no_overlap(x, residual);
  if (x.numel() == 0) {
    return;
  }
  const int64_t hidden = x.size(-1);
  const std::optional<int64_t> x_stride = uniform_row_stride(x);
  const std::optional<int64_t> r_stride = uniform_row_stride(residual);
  if (x_stride && r_stride) {
    const Rows g{x.numel() / hidden, hidden, *x_stride, *r_stride, *x_stride, *r_stride};
    at::Tensor out = x, res = residual;
    run(x, residual, weight, out, res, g, eps, paths, mode, offset);
  } else {
    // Rows that no single stride reaches: compute out of place, then copy into the inputs.
    auto [out, res] = add_rms_norm_cpu_paths(x, residual, weight, eps, rows_per_task, casting,
                                             offset, "auto", passes, task_bytes);
    x.copy_(out);
    residual.copy_(res);
  }
}

using Pair = std::tuple<at::Tensor, at::Tensor>;

constexpr auto forward_op =
    op_handle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                   c10::string_view, double, c10::string_view, c10::string_view, int64_t),
              "fusionlab::add_rms_norm_cpu", "paths">;

class AddRMSNormFunction : public torch::autograd::Function<AddRMSNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& residual, const at::Tensor& weight, double eps,
                               int64_t rows_per_task, const std::string& casting, double offset,
                               const std::string& store, const std::string& passes,
                               int64_t task_bytes, c10::DispatchKeySet below) {
    ctx->save_for_backward({x, residual, weight});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["round_sum"] = casting != "none";
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, res] =
        forward_op().redispatch(below, x, residual, weight, eps, rows_per_task, casting, offset,
                                store, passes, task_bytes);
    return {out, res};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // kernels/norm_grads.py registers it; it returns dL/dsum (= dL/dx = dL/dresidual), dL/dw.
    const auto& backward_op =
        op_handle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, double, double, bool),
                  "fusionlab::add_rms_norm_backward">();
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_total, grad_weight] = backward_op.call(
        grads[0], grads[1], saved[0], saved[1], saved[2], ctx->saved_data["eps"].toDouble(),
        ctx->saved_data["offset"].toDouble(), ctx->saved_data["round_sum"].toBool());
    return {grad_total, grad_total, grad_weight, {}, {}, {}, {}, {}, {}, {}, {}};
  }
};

// The Autograd kernels, in C++ so that a call that needs no gradient pays no Python.
Pair add_rms_norm_cpu_paths_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                     const at::Tensor& residual, const at::Tensor& weight,
                                     double eps, int64_t rows_per_task, c10::string_view casting,
                                     double offset, c10::string_view store,
                                     c10::string_view passes, int64_t task_bytes) {
  return redispatch_or_record<AddRMSNormFunction>(
      keys, forward_op(), needs_grad(x, residual, weight), x, residual, weight, eps,
      rows_per_task, casting, offset, store, passes, task_bytes);
}

Pair add_rms_norm_cpu_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                               const at::Tensor& residual, const at::Tensor& weight, double eps,
                               int64_t rows_per_task, c10::string_view casting, double offset,
                               c10::string_view store) {
  return add_rms_norm_cpu_paths_autograd(keys, x, residual, weight, eps, rows_per_task, casting,
                                         offset, store, "two", 0);
}

}  // namespace

// FRAGMENT, so other fusionlab extensions can add ops to the same namespace in one process.
TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  def_cpu_autograd(m,
                   "add_rms_norm_cpu(Tensor x, Tensor residual, Tensor weight, float eps, "
                   "int rows_per_task, str casting=\"none\", float offset=0.0, "
                   "str store=\"auto\") -> (Tensor, Tensor)",
                   &add_rms_norm_cpu, &add_rms_norm_cpu_autograd);
  // The same op with the path choices (Passes, grain_rows in cpu_norm_common.h).
  def_cpu_autograd(m,
                   "add_rms_norm_cpu.paths(Tensor x, Tensor residual, Tensor weight, float eps, "
                   "int rows_per_task, str casting=\"none\", float offset=0.0, "
                   "str store=\"auto\", str passes=\"two\", int task_bytes=0) "
                   "-> (Tensor, Tensor)",
                   &add_rms_norm_cpu_paths, &add_rms_norm_cpu_paths_autograd);
  def_cpu(m,
          "add_rms_norm_cpu_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
          "int rows_per_task, str casting=\"none\", float offset=0.0, str passes=\"two\", "
          "int task_bytes=0) -> ()",
          &add_rms_norm_cpu_);
}
