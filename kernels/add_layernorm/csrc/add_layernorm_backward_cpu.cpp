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

#include <ATen/EmptyTensor.h>
#include <torch/autograd.h>
#include <torch/library.h>

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
  const bool has_grad_sum = grad_residual_out.has_value() && grad_residual_out->defined();
  const AddBackwardInputs in =
      add_backward_inputs(kOp, grad_y, has_grad_sum ? *grad_residual_out : grad_y, x, residual,
                          weight, rows_per_task);
  TORCH_CHECK(bias.device().is_cpu() && bias.sizes() == weight.sizes() &&
                  is_supported_dtype(bias.scalar_type()),
              kOp, ": bias must be a CPU tensor of weight's shape in float32, bfloat16 or "
              "float16, got ", bias.sizes(), " ", bias.scalar_type());
  at::Tensor grad_sum(at::detail::empty_cpu(x.sizes(), x.scalar_type()));
  at::Tensor grad_weight(at::detail::empty_cpu(weight.sizes(), weight.scalar_type()));
  at::Tensor grad_bias(at::detail::empty_cpu(bias.sizes(), bias.scalar_type()));
  if (in.rows == 0) {
    grad_weight.zero_();
    grad_bias.zero_();
    return {grad_sum, grad_weight, grad_bias};
  }
  std::vector<float> w_widened;
  const at::Tensor w_in = weight.contiguous();
  const float* w = widen_to_float(w_in, w_widened);
  const RowChunks chunks = plan_chunks(in.rows, rows_per_task);
  const int64_t n = in.hidden;
  std::vector<float> dw_partials(chunks.count * n, 0.f);
  std::vector<float> db_partials(chunks.count * n, 0.f);
  const float eps_f = static_cast<float>(eps);
  AT_DISPATCH_V2(x.scalar_type(), "add_layer_norm_cpu_backward_fused", AT_WRAP([&] {
    const scalar_t* x_ptr = in.x.const_data_ptr<scalar_t>();
    const scalar_t* r_ptr = in.residual.const_data_ptr<scalar_t>();
    const scalar_t* g_ptr = in.grad_y.const_data_ptr<scalar_t>();
    const scalar_t* gs_ptr = has_grad_sum ? in.grad_sum.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* dx_ptr = grad_sum.mutable_data_ptr<scalar_t>();
    for_each_chunk(chunks, in.rows, [&](int64_t chunk, int64_t begin, int64_t end) {
      float* dw = dw_partials.data() + chunk * n;
      float* db = db_partials.data() + chunk * n;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t at = row * n;
        layer_norm_backward_row(SumOf<scalar_t>{x_ptr + at, r_ptr + at}, g_ptr + at,
                                gs_ptr != nullptr ? gs_ptr + at : nullptr, w, dx_ptr + at, dw,
                                db, n, eps_f);
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  reduce_partials(dw_partials, chunks.count, n, grad_weight);
  reduce_partials(db_partials, chunks.count, n, grad_bias);
  return {grad_sum, grad_weight, grad_bias};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// add_layer_norm_cpu itself (add_layernorm_cpu.cpp, loaded first by
// kernels/add_layernorm/cpu_backward.py).
const auto& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fusionlab::add_layer_norm_cpu", "")
          .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      double, int64_t, c10::string_view, c10::string_view, int64_t)>();
  return op;
}

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
    static const auto backward_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("fusionlab::add_layer_norm_cpu_backward_fused", "")
            .typed<Triple(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                          int64_t)>();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor grad_y = grads[0].defined() ? grads[0] : at::zeros_like(saved[0]);
    const std::optional<at::Tensor> grad_sum =
        grads[1].defined() ? std::optional<at::Tensor>(grads[1]) : std::nullopt;
    auto [grad_total, grad_weight, grad_bias] = backward_op.call(
        grad_y, grad_sum, saved[0], saved[1], saved[2], saved[3],
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
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  if (!needs_grad(x, residual, weight, bias)) {
    return forward_op().redispatch(below, x, residual, weight, bias, eps, rows_per_task, store,
                                   stats, row_group);
  }
  variable_list outputs = AddLayerNormFusedGradFunction::apply(
      x, residual, weight, bias, eps, rows_per_task, std::string(store), std::string(stats),
      row_group, below);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusionlab, m) {
  m.def("add_layer_norm_cpu_backward_fused(Tensor grad_y, Tensor? grad_residual_out, Tensor x, "
        "Tensor residual, Tensor weight, Tensor bias, float eps, int rows_per_task) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("add_layer_norm_cpu_fused_grad(Tensor x, Tensor residual, Tensor weight, Tensor bias, "
        "float eps, int rows_per_task, str store=\"auto\", str stats=\"welford\", "
        "int row_group=1) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusionlab, CPU, m) {
  m.impl("add_layer_norm_cpu_backward_fused", &add_layer_norm_cpu_backward_fused);
  m.impl("add_layer_norm_cpu_fused_grad", &add_layer_norm_cpu_fused_grad);
}

TORCH_LIBRARY_IMPL(fusionlab, Autograd, m) {
  m.impl("add_layer_norm_cpu_fused_grad", &add_layer_norm_cpu_fused_grad_autograd);
}
