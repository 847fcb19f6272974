// A row's sum of squares added in the order ATen's CPU sum kernel adds them, so that a kernel's
// rsqrt(mean(x^2) + eps) equals the one a transformers module computes with
// `x.float().pow(2).mean(-1, keepdim=True)` bit for bit (LlamaRMSNorm, GemmaRMSNorm, ...).
//
// The order (aten/src/ATen/native/cpu/SumKernel.cpp: cascade_sum -> vectorized_inner_sum ->
// row_sum -> multi_row_sum): the squares, each rounded to fp32, are read as vectors of 8 lanes
// (ATen's sum kernel is built for AVX2 at most, so 8 on x86 even where other kernels use
// AVX512); the vectors as rows of 4, summed into 4 levels of accumulators that cascade every
// 2^level_power rows; the vectors left over go into the first accumulator, then the other three
// are added to it; the scalar tail is summed first and the 8 lanes are added to it last. Rows
// shorter than 8 take ATen's scalar path: rows of 4 scalars, the same way. ATen splits a tensor
// of a single row of 32768 or more elements across threads, which rounds otherwise; model
// patching checks every key bit for bit, so such a key keeps the module's own forward.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__clang__)
#define FUSIONLAB_NO_FP_CONTRACT
#else
// No fused multiply-add: ATen rounds each square before adding it.
#define FUSIONLAB_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif

namespace fusionlab_cpu {

using Lanes8 = float __attribute__((vector_size(32)));

constexpr int64_t kSumLanes = 8;
constexpr int64_t kSumRowsOfVectors = 4;
constexpr int64_t kSumLevels = 4;

inline int64_t ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

template <typename T>
FUSIONLAB_NO_FP_CONTRACT inline Lanes8 squares8(const T* x) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  Lanes8 v;
  for (int lane = 0; lane < kSumLanes; ++lane) {
    v[lane] = static_cast<float>(x[lane]);
  }
  return v * v;
}

template <typename T>
FUSIONLAB_NO_FP_CONTRACT float torch_order_sum_sq(const T* x, int64_t n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  if (n < kSumLanes) {  // ATen's scalar_inner_sum: the same rows of 4, over scalars
    float part[kSumRowsOfVectors] = {};
    int64_t e = 0;
    for (; n >= kSumRowsOfVectors && e < kSumRowsOfVectors; ++e) {
      const float s = static_cast<float>(x[e]);
      part[e] = s * s;
    }
    for (; e < n; ++e) {
      const float s = static_cast<float>(x[e]);
      part[0] += s * s;
    }
    for (int64_t k = 1; k < kSumRowsOfVectors; ++k) {
      part[0] += part[k];
    }
    return part[0];
  }
  const int64_t vectors = n / kSumLanes;
  const int64_t rows = vectors / kSumRowsOfVectors;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(rows) / kSumLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  Lanes8 acc[kSumLevels][kSumRowsOfVectors] = {};
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int64_t k = 0; k < kSumRowsOfVectors; ++k) {
        acc[0][k] += squares8(x + (i * kSumRowsOfVectors + k) * kSumLanes);
      }
    }
    for (int64_t level = 1; level < kSumLevels; ++level) {
      for (int64_t k = 0; k < kSumRowsOfVectors; ++k) {
        acc[level][k] += acc[level - 1][k];
        acc[level - 1][k] = Lanes8{};
      }
      if ((i & (level_mask << (level * level_power))) != 0) {
        break;
      }
    }
  }
  for (; i < rows; ++i) {
    for (int64_t k = 0; k < kSumRowsOfVectors; ++k) {
      acc[0][k] += squares8(x + (i * kSumRowsOfVectors + k) * kSumLanes);
    }
  }
  for (int64_t level = 1; level < kSumLevels; ++level) {
    for (int64_t k = 0; k < kSumRowsOfVectors; ++k) {
      acc[0][k] += acc[level][k];
    }
  }
  Lanes8 total = acc[0][0];
  for (int64_t v = rows * kSumRowsOfVectors; v < vectors; ++v) {
    total += squares8(x + v * kSumLanes);
  }
  for (int64_t k = 1; k < kSumRowsOfVectors; ++k) {
    total += acc[0][k];
  }
  float sum = 0.f;
  for (int64_t e = vectors * kSumLanes; e < n; ++e) {
    const float s = static_cast<float>(x[e]);
    sum += s * s;
  }
  for (int lane = 0; lane < kSumLanes; ++lane) {
    sum += total[lane];
  }
  return sum;
}

}  // namespace fusionlab_cpu
