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
#include "torch_order_sum.h"

#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

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

// Sum of the squares of s = x + r (in fp32) with four independent accumulators: several FMAs in
// flight instead of one dependent chain.
template <typename T>
float fast_add_sum_sq(const T* x, const T* r, int64_t n) {
  fVec acc0(0.f), acc1(0.f), acc2(0.f), acc3(0.f);
  int64_t i = 0;
  for (; i + 2 * kBlock <= n; i += 2 * kBlock) {
    fVec a, b, c, d, ra, rb, rc, rd;
    load_block(x + i, a, b);
    load_block(x + i + kBlock, c, d);
    load_block(r + i, ra, rb);
    load_block(r + i + kBlock, rc, rd);
    add_block<false, T>(a, b, ra, rb);
    add_block<false, T>(c, d, rc, rd);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
    acc2 = at::vec::fmadd(c, c, acc2);
    acc3 = at::vec::fmadd(d, d, acc3);
  }
  if (i + kBlock <= n) {
    fVec a, b, ra, rb;
    load_block(x + i, a, b);
    load_block(r + i, ra, rb);
    add_block<false, T>(a, b, ra, rb);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
    i += kBlock;
  }
  float sum_sq = at::vec::vec_reduce_all<float>(
      [](const fVec& u, const fVec& v) { return u + v; }, (acc0 + acc1) + (acc2 + acc3));
  for (; i < n; ++i) {
    const float s = add_scalar<false>(x[i], r[i]);
    sum_sq += s * s;
  }
  return sum_sq;
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
    sum_sq = fast_add_sum_sq(x, r, n);
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

// The instantiation for this call's store kind, casting ("none", "gemma", "llama") and passes.
template <typename T>
auto add_rms_norm_rows_for(bool stream, Casting casting, Passes passes) {
  using Fn = decltype(&add_rms_norm_rows<false, false, false, false, T>);
  static constexpr Fn table[2][3][2] = {
      {{add_rms_norm_rows<false, false, false, false, T>,
        add_rms_norm_rows<false, false, false, true, T>},
       {add_rms_norm_rows<false, true, false, false, T>,
        add_rms_norm_rows<false, true, false, true, T>},
       {add_rms_norm_rows<false, true, true, false, T>,
        add_rms_norm_rows<false, true, true, true, T>}},
      {{add_rms_norm_rows<true, false, false, false, T>,
        add_rms_norm_rows<true, false, false, true, T>},
       {add_rms_norm_rows<true, true, false, false, T>,
        add_rms_norm_rows<true, true, false, true, T>},
       {add_rms_norm_rows<true, true, true, false, T>,
        add_rms_norm_rows<true, true, true, true, T>}}};
  const int numerics = !casting.round_sum ? 0 : (casting.round_normed ? 2 : 1);
  return table[stream][numerics][passes == Passes::kOne];
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

void check_arguments(const char* op, const at::Tensor& x, const at::Tensor& residual,
                     const at::Tensor& weight, double eps, int64_t rows_per_task) {
  TORCH_CHECK(x.device().is_cpu() && residual.device().is_cpu() && weight.device().is_cpu(),
              op, ": x, residual and weight must be CPU tensors, got ", x.device(), ", ",
              residual.device(), " and ", weight.device());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dim");
  TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual must have x's shape ", x.sizes(),
              ", got ", residual.sizes());
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, op,
              ": weight must be 1-D of size ", hidden, " (x.size(-1)), got shape ",
              weight.sizes());
  TORCH_CHECK(is_supported_dtype(x.scalar_type()) && is_supported_dtype(weight.scalar_type()),
              op, ": dtypes must be float32, bfloat16 or float16, got x ", x.scalar_type(),
              " and weight ", weight.scalar_type());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), op,
              ": residual must have x's dtype ", x.scalar_type(), ", got ",
              residual.scalar_type());
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(rows_per_task >= 1, op, ": rows_per_task must be >= 1, got ", rows_per_task);
}

// Runs the kernel from x and residual (rows at uniform strides) into out and res.
void run(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, at::Tensor& out,
         at::Tensor& res, const Rows& g, double eps, const Paths& paths, Casting casting,
         double offset) {
  const at::Tensor w_in = weight.contiguous();
  std::vector<float> w_widened;
  const float* w = widen_to_float(w_in, w_widened, static_cast<float>(offset));
  const float eps_f = static_cast<float>(eps);
  AT_DISPATCH_V2(x.scalar_type(), "add_rms_norm_cpu", AT_WRAP([&] {
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    scalar_t* res_ptr = res.mutable_data_ptr<scalar_t>();
    const int64_t size = sizeof(scalar_t);
    const bool stream = should_stream(out_ptr, g.hidden, size, out.nbytes(), paths.store) &&
                        should_stream(res_ptr, g.hidden, size, res.nbytes(), paths.store);
    const int64_t grain = grain_rows(paths.rows_per_task, paths.task_bytes, g.hidden * size);
    add_rms_norm_rows_for<scalar_t>(stream, casting, paths.passes)(
        x.const_data_ptr<scalar_t>(), residual.const_data_ptr<scalar_t>(), w, out_ptr, res_ptr,
        g, eps_f, grain);
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu_paths(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
    int64_t rows_per_task, c10::string_view casting, double offset, c10::string_view store,
    c10::string_view passes, int64_t task_bytes) {
  const char* op = "fusionlab::add_rms_norm_cpu";
  check_arguments(op, x, residual, weight, eps, rows_per_task);
  const Casting mode = parse_casting(casting, op);
  const Paths paths = parse_paths(op, rows_per_task, store, passes, task_bytes);
  // Allocated without the dispatcher so a profiled call is a single op record.
  at::Tensor out(at::detail::empty_cpu(x.sizes(), x.scalar_type()));
  at::Tensor res(at::detail::empty_cpu(x.sizes(), x.scalar_type()));
  if (x.numel() == 0) {
    return {out, res};
  }
  const int64_t hidden = x.size(-1);
  const std::optional<int64_t> x_stride = uniform_row_stride(x);
  const std::optional<int64_t> r_stride = uniform_row_stride(residual);
  const at::Tensor x_src = x_stride ? x : x.contiguous();
  const at::Tensor r_src = r_stride ? residual : residual.contiguous();
  const Rows g{x.numel() / hidden, hidden, x_stride.value_or(hidden), r_stride.value_or(hidden),
               hidden, hidden};
  run(x_src, r_src, weight, out, res, g, eps, paths, mode, offset);
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
  check_arguments(op, x, residual, weight, eps, rows_per_task);
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

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Pair = std::tuple<at::Tensor, at::Tensor>;

const auto& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fusionlab::add_rms_norm_cpu", "paths")
          .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                      c10::string_view, double, c10::string_view, c10::string_view,
                      int64_t)>();
  return op;
}

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
    static const auto backward_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("fusionlab::add_rms_norm_backward", "")
            .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, double, double, bool)>();
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
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  if (!needs_grad(x, residual, weight)) {
    return forward_op().redispatch(below, x, residual, weight, eps, rows_per_task, casting,
                                   offset, store, passes, task_bytes);
  }
  variable_list outputs = AddRMSNormFunction::apply(
      x, residual, weight, eps, rows_per_task, std::string(casting), offset, std::string(store),
      std::string(passes), task_bytes, below);
  return {outputs[0], outputs[1]};
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
  m.def("add_rms_norm_cpu(Tensor x, Tensor residual, Tensor weight, float eps, "
        "int rows_per_task, str casting=\"none\", float offset=0.0, str store=\"auto\") "
        "-> (Tensor, Tensor)");
  // The same op with the path choices (Passes, grain_rows in cpu_norm_common.h).
  m.def("add_rms_norm_cpu.paths(Tensor x, Tensor residual, Tensor weight, float eps, "
        "int rows_per_task, str casting=\"none\", float offset=0.0, str store=\"auto\", "
        "str passes=\"two\", int task_bytes=0) -> (Tensor, Tensor)");
  m.def("add_rms_norm_cpu_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
        "int rows_per_task, str casting=\"none\", float offset=0.0, str passes=\"two\", "
        "int task_bytes=0) -> ()");
}

TORCH_LIBRARY_IMPL(fusionlab, CPU, m) {
  m.impl("add_rms_norm_cpu", &add_rms_norm_cpu);
  m.impl("add_rms_norm_cpu.paths", &add_rms_norm_cpu_paths);
  m.impl("add_rms_norm_cpu_", &add_rms_norm_cpu_);
}

TORCH_LIBRARY_IMPL(fusionlab, Autograd, m) {
  m.impl("add_rms_norm_cpu", &add_rms_norm_cpu_autograd);
  m.impl("add_rms_norm_cpu.paths", &add_rms_norm_cpu_paths_autograd);
}
