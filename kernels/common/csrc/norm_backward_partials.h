// The weight (and bias) gradients of fusionlab's fused C++ norm backward kernels, as Apex and
// Liger reduce them: the rows are split into at most one chunk per thread, each chunk sums its
// rows' contributions into its own fp32 partial row, and the partials are summed at the end in a
// fixed order (the result does not depend on which thread ran which chunk).
#pragma once

#include "norm_args.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fusionlab_cpu {

// Rows [begin, end) of one chunk; chunks of `rows_per_chunk` rows (the last may be shorter).
struct RowChunks {
  int64_t count;
  int64_t rows_per_chunk;
};

// One chunk per thread at most, and at least rows_per_task rows a chunk (fewer threads wake for
// small inputs, as the forward kernels' parallel grain does).
inline RowChunks plan_chunks(int64_t rows, int64_t rows_per_task) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t by_grain = (rows + rows_per_task - 1) / rows_per_task;
  const int64_t count = std::max<int64_t>(1, std::min(threads, by_grain));
  return {count, (rows + count - 1) / count};
}

// Sums `count` partial rows of `hidden` fp32 values (laid out one after another) into `out`,
// a contiguous 1-D tensor of any floating dtype, in chunk order.
inline void reduce_partials(const std::vector<float>& partials, int64_t count, int64_t hidden,
                            at::Tensor& out) {
  std::vector<float> total(partials.begin(), partials.begin() + hidden);
  for (int64_t c = 1; c < count; ++c) {
    const float* row = partials.data() + c * hidden;
    for (int64_t j = 0; j < hidden; ++j) {
      total[j] += row[j];
    }
  }
  AT_DISPATCH_V2(out.scalar_type(), "fusionlab_reduce_partials", AT_WRAP([&] {
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    for (int64_t j = 0; j < hidden; ++j) {
      dst[j] = static_cast<scalar_t>(total[j]);
    }
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

// Runs body(chunk, begin_row, end_row) for every chunk, in parallel.
template <typename Body>
void for_each_chunk(const RowChunks& chunks, int64_t rows, const Body& body) {
  at::parallel_for(0, chunks.count, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t begin = c * chunks.rows_per_chunk;
      const int64_t end = std::min(rows, begin + chunks.rows_per_chunk);
      if (begin < end) {
        body(c, begin, end);
      }
    }
  });
}

// What a fused backward returns: dx in x's dtype, written row by row, and the weight (and bias,
// undefined where the op has none) gradients in their parameters' dtypes.
struct NormGrads {
  at::Tensor x, weight, bias;
};

inline NormGrads empty_grads(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor* bias) {
  return {empty_cpu_like(x), empty_cpu_like(weight),
          bias == nullptr ? at::Tensor() : empty_cpu_like(*bias)};
}

// Runs row(r, dw, db) for every one of `rows` rows, dw and db (null without a bias) the fp32
// partial rows of its chunk, then writes the partials' sums into grads.weight and grads.bias
// (zeros when there are no rows).
template <typename Row>
void sum_param_grads(int64_t rows, int64_t hidden, int64_t rows_per_task, NormGrads& grads,
                     const Row& row) {
  const RowChunks chunks = plan_chunks(rows, rows_per_task);
  const bool has_bias = grads.bias.defined();
  std::vector<float> dw_partials(chunks.count * hidden, 0.f);
  std::vector<float> db_partials(has_bias ? chunks.count * hidden : 0, 0.f);
  for_each_chunk(chunks, rows, [&](int64_t chunk, int64_t begin, int64_t end) {
    float* dw = dw_partials.data() + chunk * hidden;
    float* db = has_bias ? db_partials.data() + chunk * hidden : nullptr;
    for (int64_t r = begin; r < end; ++r) {
      row(r, dw, db);
    }
  });
  reduce_partials(dw_partials, chunks.count, hidden, grads.weight);
  if (has_bias) {
    reduce_partials(db_partials, chunks.count, hidden, grads.bias);
  }
}

}  // namespace fusionlab_cpu
