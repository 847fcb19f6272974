// Row mean and variance by Welford's update, shared by the LayerNorm kernels (layernorm,
// add_layernorm): one read of the row, all statistics in fp32 vectors merged in fp64.
//
// Why Welford: the one-pass alternative, var = E[x^2] - E[x]^2 from plain fp32 sums, cancels
// catastrophically once |mean| >> std (hidden states with large offsets or outlier channels): its
// relative error grows like 2^-24 * (mean/std)^2. Welford's update keeps a running mean and the
// centred sum of squares M2, so the error stays O(n * 2^-24) whatever the mean, in the same single
// read. It runs per SIMD lane over four independent chains (the latency of the mean update is
// hidden), and chains, lanes and the scalar tail are merged with Chan et al.'s pairwise formula,
// as ATen's own RowwiseMoments does (aten/src/ATen/native/cpu/moments_utils.h).
#pragma once

#include "cpu_norm_common.h"

#include <algorithm>
#include <cstdint>

namespace fusionlab_cpu {

struct Moments {
  double count = 0.0;
  double mean = 0.0;
  double m2 = 0.0;  // sum of squared deviations from mean
};

// Chan, Golub and LeVeque's pairwise merge of two partial results.
inline Moments merge(const Moments& a, const Moments& b) {
  if (b.count == 0.0) {
    return a;
  }
  const double count = a.count + b.count;
  const double delta = b.mean - a.mean;
  return {count, a.mean + delta * (b.count / count),
          a.m2 + b.m2 + delta * delta * (a.count * b.count / count)};
}

inline void welford_step(const fVec& v, const fVec& inv_count, fVec& mean, fVec& m2) {
  const fVec delta = v - mean;
  mean = at::vec::fmadd(delta, inv_count, mean);
  m2 = at::vec::fmadd(delta, v - mean, m2);
}

// `total` (the moments of the first i values) merged with those of the rest of the row, under
// 2 * kBlock values: exact two-pass moments in fp64, then one merge.
template <typename Row>
Moments with_tail(const Moments& total, const Row& row, int64_t i, int64_t n) {
  if (i >= n) {
    return total;
  }
  Moments tail;
  tail.count = static_cast<double>(n - i);
  double sum = 0.0;
  for (int64_t j = i; j < n; ++j) {
    sum += static_cast<double>(row.at(j));
  }
  tail.mean = sum / tail.count;
  for (int64_t j = i; j < n; ++j) {
    const double d = static_cast<double>(row.at(j)) - tail.mean;
    tail.m2 += d * d;
  }
  return merge(total, tail);
}

// Mean and M2 of the n values `row` yields, reading each block once.
template <typename Row>
Moments row_moments(const Row& row, int64_t n) {
  constexpr int64_t kLanes = fVec::size();
  fVec mean[4] = {fVec(0.f), fVec(0.f), fVec(0.f), fVec(0.f)};
  fVec m2[4] = {fVec(0.f), fVec(0.f), fVec(0.f), fVec(0.f)};
  int64_t steps = 0;
  int64_t i = 0;
  for (; i + 2 * kBlock <= n; i += 2 * kBlock) {
    ++steps;
    const fVec inv_count(1.f / static_cast<float>(steps));
    fVec a, b, c, d;
    row.block_unordered(i, a, b);
    row.block_unordered(i + kBlock, c, d);
    welford_step(a, inv_count, mean[0], m2[0]);
    welford_step(b, inv_count, mean[1], m2[1]);
    welford_step(c, inv_count, mean[2], m2[2]);
    welford_step(d, inv_count, mean[3], m2[3]);
  }
  Moments total;
  if (steps > 0) {
    // Every lane of every chain saw `steps` values, so the merges are equal-count ones: the mean
    // of the means, and M2 = sum of M2s + steps * sum of squared deviations of the means. Both
    // sum non-negative terms (no cancellation), so fp32 vectors suffice and no division is needed.
    const auto add = [](const fVec& u, const fVec& v) { return u + v; };
    const fVec lane_mean = ((mean[0] + mean[1]) + (mean[2] + mean[3])) * fVec(0.25f);
    fVec lane_m2 = (m2[0] + m2[1]) + (m2[2] + m2[3]);
    fVec spread(0.f);
    for (const fVec& m : mean) {
      spread = at::vec::fmadd(m - lane_mean, m - lane_mean, spread);
    }
    lane_m2 = at::vec::fmadd(spread, fVec(static_cast<float>(steps)), lane_m2);
    const float row_mean = at::vec::vec_reduce_all<float>(add, lane_mean) / kLanes;
    const fVec deviation = lane_mean - fVec(row_mean);
    const float lanes_spread = at::vec::vec_reduce_all<float>(add, deviation * deviation);
    total.count = static_cast<double>(steps * 4 * kLanes);
    total.mean = row_mean;
    total.m2 = static_cast<double>(at::vec::vec_reduce_all<float>(add, lane_m2)) +
               4.0 * static_cast<double>(steps) * lanes_spread;
  }
  return with_tail(total, row, i, n);
}

// The "shifted" statistics: the same single read, but plain fp32 sums of d = x - shift and d^2
// (one add and one FMA per vector instead of Welford's two of each), shift being the mean of the
// row's first block. M2 = sum(d^2) - sum(d)^2 / n then cancels only as far as |mean - shift|
// exceeds the spread, not as |mean| does: a relative error of about 2^-24 * ((mean - shift) /
// std)^2, small unless the first block sits far from the rest of the row. The sweep's float64
// gate decides per cell whether it is close enough; Welford stays the default.
template <typename Row>
Moments shifted_moments(const Row& row, int64_t n) {
  if (n < 2 * kBlock) {
    return row_moments(row, n);
  }
  const auto add = [](const fVec& u, const fVec& v) { return u + v; };
  fVec a, b, c, d;
  row.block_unordered(0, a, b);
  const float shift = at::vec::vec_reduce_all<float>(add, a + b) / static_cast<float>(kBlock);
  const fVec k(shift);
  fVec s[4] = {fVec(0.f), fVec(0.f), fVec(0.f), fVec(0.f)};
  fVec q[4] = {fVec(0.f), fVec(0.f), fVec(0.f), fVec(0.f)};
  int64_t i = 0;
  for (; i + 2 * kBlock <= n; i += 2 * kBlock) {
    row.block_unordered(i, a, b);
    row.block_unordered(i + kBlock, c, d);
    a = a - k, b = b - k, c = c - k, d = d - k;
    s[0] = s[0] + a, s[1] = s[1] + b, s[2] = s[2] + c, s[3] = s[3] + d;
    q[0] = at::vec::fmadd(a, a, q[0]);
    q[1] = at::vec::fmadd(b, b, q[1]);
    q[2] = at::vec::fmadd(c, c, q[2]);
    q[3] = at::vec::fmadd(d, d, q[3]);
  }
  const double sum = at::vec::vec_reduce_all<float>(add, (s[0] + s[1]) + (s[2] + s[3]));
  const double sum_sq = at::vec::vec_reduce_all<float>(add, (q[0] + q[1]) + (q[2] + q[3]));
  Moments total;
  total.count = static_cast<double>(i);
  total.mean = shift + sum / total.count;
  total.m2 = std::max(0.0, sum_sq - sum * sum / total.count);
  return with_tail(total, row, i, n);
}

// Which statistics a LayerNorm kernel takes: Welford's (default) or shifted sums.
enum class Stats { kWelford, kShifted };

inline Stats parse_stats(c10::string_view stats, const char* op) {
  TORCH_CHECK(stats == "welford" || stats == "shifted", op,
              ": stats must be welford or shifted, got ", stats);
  return stats == "welford" ? Stats::kWelford : Stats::kShifted;
}

template <Stats kStats, typename Row>
Moments moments_of(const Row& row, int64_t n) {
  if constexpr (kStats == Stats::kWelford) {
    return row_moments(row, n);
  } else {
    return shifted_moments(row, n);
  }
}

}  // namespace fusionlab_cpu
