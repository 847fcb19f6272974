// One row of the fused C++ norm backward kernels, written once for any row source: a tensor's
// row (RowOf) or the fp32 sum of two rows that a residual-add kernel forms (SumOf, RoundedSumOf,
// from welford_moments.h and below). `g` is the upstream gradient of the normalised output;
// `g_sum`, when not null, is the upstream gradient of the row itself (add kernels' residual_out,
// which is the sum) and is added into dx: for s = x + residual, dx = dresidual = ds.
// dx is written in T, the weight (and bias) gradients added into the chunk's fp32 partial rows
// (norm_backward_partials.h).
#pragma once

#include "cpu_norm_common.h"
#include "welford_moments.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace fusionlab_cpu {

// T as written, not deduced: g_sum may then be a plain nullptr.
template <typename T>
using NoDeduce = std::type_identity_t<T>;

// The fp32 sum of two rows rounded to T, as a model's own `residual + hidden_states` is.
template <typename T>
struct RoundedSumOf {
  const T* x;
  const T* r;
  void block(int64_t i, fVec& lo, fVec& hi) const {
    SumOf<T>{x, r}.block(i, lo, hi);
    round_block<T>(lo, hi);
  }
  void block_unordered(int64_t i, fVec& lo, fVec& hi) const {
    SumOf<T>{x, r}.block_unordered(i, lo, hi);
    round_block<T>(lo, hi);
  }
  float at(int64_t i) const { return round_scalar<T>(SumOf<T>{x, r}.at(i)); }
};

// dx + the row's own upstream gradient, stored in T.
template <typename T>
inline void store_grad_block(T* dx, const T* g_sum, int64_t i, fVec lo, fVec hi) {
  if (g_sum != nullptr) {
    fVec g_lo, g_hi;
    load_block(g_sum + i, g_lo, g_hi);
    lo = lo + g_lo, hi = hi + g_hi;
  }
  store_block<false>(dx + i, lo, hi);
}

template <typename T>
inline float grad_scalar(const T* g_sum, int64_t i, float v) {
  return g_sum != nullptr ? v + static_cast<float>(g_sum[i]) : v;
}

// Runs body(i, s_lo, s_hi, g_lo, g_hi) on each whole block of the row and of g, in order; returns
// where the scalar tail starts.
template <typename Row, typename T, typename Body>
inline int64_t for_each_block(const Row& s, const T* g, int64_t n, const Body& body) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fVec s_lo, s_hi, g_lo, g_hi;
    s.block(i, s_lo, s_hi);
    load_block(g + i, g_lo, g_hi);
    body(i, s_lo, s_hi, g_lo, g_hi);
  }
  return i;
}

// RMSNorm, with r = rsqrt(mean(s^2) + eps) and w the weight plus its offset:
//   ds = r * g * w - s * r^3 * mean(g * w * s),    dweight += g * s * r.
// Pass 1 reads s and g for both sums (kSavedRstd: r is `saved_rstd`, the forward's, and pass 1
// sums the dot product alone), pass 2 (from cache) writes ds and the partial dweight.
template <bool kSavedRstd = false, typename T, typename Row>
void rms_norm_backward_row(const Row& s, const T* g, const NoDeduce<T>* g_sum, const float* w,
                           T* dx, float* dw, int64_t n, float eps, float saved_rstd = 0.f) {
  fVec sq0(0.f), sq1(0.f), dot0(0.f), dot1(0.f);
  int64_t i = for_each_block(s, g, n, [&](int64_t j, auto s_lo, auto s_hi, auto g_lo, auto g_hi) {
    if constexpr (!kSavedRstd) {
      sq0 = at::vec::fmadd(s_lo, s_lo, sq0);
      sq1 = at::vec::fmadd(s_hi, s_hi, sq1);
    }
    dot0 = at::vec::fmadd(g_lo * fVec::loadu(w + j), s_lo, dot0);
    dot1 = at::vec::fmadd(g_hi * fVec::loadu(w + j + fVec::size()), s_hi, dot1);
  });
  const auto add = [](const fVec& u, const fVec& v) { return u + v; };
  float sum_sq = kSavedRstd ? 0.f : at::vec::vec_reduce_all<float>(add, sq0 + sq1);
  float dot = at::vec::vec_reduce_all<float>(add, dot0 + dot1);
  for (; i < n; ++i) {
    const float sv = s.at(i);
    sum_sq += sv * sv;
    dot += static_cast<float>(g[i]) * w[i] * sv;
  }
  const float inv_n = 1.f / static_cast<float>(n);
  const float r = kSavedRstd ? saved_rstd : 1.f / std::sqrt(sum_sq * inv_n + eps);
  const float c = r * r * r * dot * inv_n;
  const fVec vr(r), vc(c);
  i = for_each_block(s, g, n, [&](int64_t j, auto s_lo, auto s_hi, auto g_lo, auto g_hi) {
    const fVec w_lo = fVec::loadu(w + j), w_hi = fVec::loadu(w + j + fVec::size());
    store_grad_block(dx, g_sum, j, vr * g_lo * w_lo - vc * s_lo, vr * g_hi * w_hi - vc * s_hi);
    at::vec::fmadd(g_lo * s_lo, vr, fVec::loadu(dw + j)).store(dw + j);
    at::vec::fmadd(g_hi * s_hi, vr, fVec::loadu(dw + j + fVec::size())).store(dw + j + fVec::size());
  });
  for (; i < n; ++i) {
    const float sv = s.at(i);
    const float gv = static_cast<float>(g[i]);
    dx[i] = static_cast<T>(grad_scalar(g_sum, i, r * gv * w[i] - c * sv));
    dw[i] += gv * sv * r;
  }
}

// LayerNorm, with mean m, r = rsqrt(var + eps), shat = (s - m) * r and gw = g * weight:
//   ds = r * (gw - mean(gw) - shat * mean(gw * shat)),  dweight += g * shat,  dbias += g.
// Given the row's mean and r: two reads of the row, the two row sums, then ds and the partials.
template <typename T, typename Row>
void layer_norm_backward_row_with(const Row& s, const T* g, const NoDeduce<T>* g_sum,
                                  const float* w, T* dx, float* dw, float* db, int64_t n,
                                  float mean, float r) {
  const fVec vmean(mean), vr(r);
  fVec gw0(0.f), gw1(0.f), gws0(0.f), gws1(0.f);
  int64_t i = for_each_block(s, g, n, [&](int64_t j, auto s_lo, auto s_hi, auto g_lo, auto g_hi) {
    const fVec gw_lo = g_lo * fVec::loadu(w + j);
    const fVec gw_hi = g_hi * fVec::loadu(w + j + fVec::size());
    gw0 = gw0 + gw_lo;
    gw1 = gw1 + gw_hi;
    gws0 = at::vec::fmadd(gw_lo, (s_lo - vmean) * vr, gws0);
    gws1 = at::vec::fmadd(gw_hi, (s_hi - vmean) * vr, gws1);
  });
  const auto add = [](const fVec& u, const fVec& v) { return u + v; };
  float sum_gw = at::vec::vec_reduce_all<float>(add, gw0 + gw1);
  float sum_gw_shat = at::vec::vec_reduce_all<float>(add, gws0 + gws1);
  for (; i < n; ++i) {
    const float gw = static_cast<float>(g[i]) * w[i];
    sum_gw += gw;
    sum_gw_shat += gw * (s.at(i) - mean) * r;
  }
  const float inv_n = 1.f / static_cast<float>(n);
  const fVec vmean_gw(sum_gw * inv_n), vmean_gw_shat(sum_gw_shat * inv_n);
  i = for_each_block(s, g, n, [&](int64_t j, auto s_lo, auto s_hi, auto g_lo, auto g_hi) {
    const fVec shat_lo = (s_lo - vmean) * vr, shat_hi = (s_hi - vmean) * vr;
    const fVec gw_lo = g_lo * fVec::loadu(w + j);
    const fVec gw_hi = g_hi * fVec::loadu(w + j + fVec::size());
    store_grad_block(dx, g_sum, j, vr * (gw_lo - vmean_gw - shat_lo * vmean_gw_shat),
                     vr * (gw_hi - vmean_gw - shat_hi * vmean_gw_shat));
    at::vec::fmadd(g_lo, shat_lo, fVec::loadu(dw + j)).store(dw + j);
    at::vec::fmadd(g_hi, shat_hi, fVec::loadu(dw + j + fVec::size())).store(dw + j + fVec::size());
    (fVec::loadu(db + j) + g_lo).store(db + j);
    (fVec::loadu(db + j + fVec::size()) + g_hi).store(db + j + fVec::size());
  });
  const float mean_gw = sum_gw * inv_n, mean_gw_shat = sum_gw_shat * inv_n;
  for (; i < n; ++i) {
    const float gv = static_cast<float>(g[i]);
    const float shat = (s.at(i) - mean) * r;
    dx[i] = static_cast<T>(grad_scalar(g_sum, i, r * (gv * w[i] - mean_gw - shat * mean_gw_shat)));
    dw[i] += gv * shat;
    db[i] += gv;
  }
}

// The same, with the row's mean and r recomputed first (Welford moments, as the forward): three
// reads of the row, the last two from cache.
template <typename T, typename Row>
void layer_norm_backward_row(const Row& s, const T* g, const NoDeduce<T>* g_sum,
                             const float* w, T* dx, float* dw, float* db, int64_t n, float eps) {
  const Moments moments = row_moments(s, n);
  const float mean = static_cast<float>(moments.mean);
  const float r = static_cast<float>(1.0 / std::sqrt(moments.m2 / moments.count + eps));
  layer_norm_backward_row_with(s, g, g_sum, w, dx, dw, db, n, mean, r);
}

}  // namespace fusionlab_cpu
