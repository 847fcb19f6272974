// Helpers shared by fusionlab's CPU normalization kernels (rmsnorm, layernorm, add_rmsnorm):
// fp32 block loads/stores of float/bfloat16/half rows, non-temporal stores, the mapped-pages
// test that decides streaming, uniform row strides and weight widening.
// The vector ISA is whatever CPU_CAPABILITY the build passes in (see kernels/cpp_build.py).
#pragma once

#include <ATen/Dispatch_v2.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#define FUSIONLAB_CAN_STREAM 1
#else
#define FUSIONLAB_CAN_STREAM 0
#endif

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace fusionlab_cpu {

using fVec = at::vec::Vectorized<float>;
// Elements per block: two fp32 vectors, i.e. one full 16-bit vector for BFloat16/Half.
constexpr int64_t kBlock = 2 * fVec::size();

// Outputs at least this big are written with non-temporal stores: they would not stay in a
// core's caches anyway, and streaming skips the read-for-ownership of the output. Measured on
// Zen 4 (rmsnorm): up to ~2x faster from 8 MiB, slower below 2 MiB. Only when the output's pages
// are already mapped, though (see output_pages_mapped).
constexpr int64_t kStreamMinBytes = int64_t{8} << 20;

template <typename T>
inline void load_block(const T* p, fVec& lo, fVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = fVec::loadu(p);
    hi = fVec::loadu(p + fVec::size());
  } else {
    at::vec::load_to_float<T>(p, lo, hi);
  }
}

// One block as fp32 in an order the caller must not rely on (sums, row statistics): for bf16 in
// a vector build, the even elements in lo and the odd ones in hi, two instructions (a shift and a
// mask of each 32-bit pair) where load_block's in-order widening takes four or five.
template <typename T>
inline void load_block_unordered(const T* p, fVec& lo, fVec& hi) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i v = _mm512_loadu_si512(p);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
    return;
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
    return;
#endif
  }
  load_block(p, lo, hi);
}

// Whether the memory behind [p, p + bytes) has already been touched. Allocations too big for the
// malloc heap (glibc: over 32 MiB) come fresh from mmap, so every first store to a page faults
// and the kernel zeroes that page through the cache: the read-for-ownership that streaming saves
// is already paid, and non-temporal stores then only evict the just-zeroed lines (measured 3-8%
// slower than plain stores at 32-128 MiB fp32, where the faults bound both). One page near the
// end decides: the first may hold the allocator's header, and a reused heap block is resident.
inline bool output_pages_mapped(const void* p, int64_t bytes) {
#if defined(__linux__)
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto last = (reinterpret_cast<std::uintptr_t>(p) + bytes - 1) & ~(page - 1);
  unsigned char resident = 0;
  if (mincore(reinterpret_cast<void*>(last), page, &resident) == 0) {
    return (resident & 1) != 0;
  }
#endif
  return true;  // unknown: keep streaming, the right call for a reused buffer
}

// How outputs are stored, the `store` argument of every out-of-place op: "auto" streams outputs of
// kStreamMinBytes or more, "stream" streams at any size, "plain" never does. Streaming needs
// vector-aligned rows and pages already mapped (else every choice stores plainly), and a build
// with a vector ISA.
enum class StoreKind { kAuto, kPlain, kStream };

inline StoreKind parse_store(c10::string_view store, const char* op) {
  TORCH_CHECK(store == "auto" || store == "plain" || store == "stream", op,
              ": store must be auto, plain or stream, got ", store);
  return store == "auto" ? StoreKind::kAuto
                         : (store == "plain" ? StoreKind::kPlain : StoreKind::kStream);
}

inline bool should_stream(const void* y, int64_t hidden, int64_t element_size, int64_t bytes,
                          StoreKind kind) {
  if (kind == StoreKind::kPlain || (kind == StoreKind::kAuto && bytes < kStreamMinBytes)) {
    return false;
  }
  const bool aligned =
      reinterpret_cast<std::uintptr_t>(y) % 64 == 0 && hidden * element_size % 64 == 0;
  return FUSIONLAB_CAN_STREAM && aligned && output_pages_mapped(y, bytes);
}

// Non-temporal store of one vector to a vector-aligned address.
template <typename V>
inline void stream_store(void* p, const V& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<V, fVec>) {
    _mm512_stream_ps(static_cast<float*>(p), v);
  } else {
    _mm512_stream_si512(static_cast<__m512i*>(p), v);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<V, fVec>) {
    _mm256_stream_ps(static_cast<float*>(p), v);
  } else {
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
  }
#else
  v.store(p);
#endif
}

// Non-temporal stores are weakly ordered: publish them before a task returns.
inline void stream_fence() {
#if FUSIONLAB_CAN_STREAM
  _mm_sfence();
#endif
}

template <bool kStream, typename T>
inline void store_block(T* p, const fVec& lo, const fVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    if constexpr (kStream) {
      stream_store(p, lo);
      stream_store(p + fVec::size(), hi);
    } else {
      lo.store(p);
      hi.store(p + fVec::size());
    }
  } else {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    // One instruction instead of ATen's ~16-op software rounding, which otherwise bounds the
    // bf16 kernels; like all AVX512-BF16 conversions it flushes denormal results to zero.
    const auto packed = [&] {
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        return at::vec::Vectorized<T>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
      } else {
        return at::vec::convert_from_float<T>(lo, hi);
      }
    }();
#else
    const auto packed = at::vec::convert_from_float<T>(lo, hi);
#endif
    if constexpr (kStream) {
      stream_store(p, packed);
    } else {
      packed.store(p);
    }
  }
}

// Pulls one block of the row processed next toward L2, so DRAM reads keep going while this row
// is written instead of all waiting for the next row's first pass.
template <typename T>
inline void prefetch_block(const T* p) {
  for (int64_t byte = 0; byte < kBlock * static_cast<int64_t>(sizeof(T)); byte += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(p) + byte, 0, 2);
  }
}

// A row read as fp32 blocks: one tensor's row, or (the add kernels) the fp32 sum of two rows.
template <typename T>
struct RowOf {
  const T* x;
  void block(int64_t i, fVec& lo, fVec& hi) const { load_block(x + i, lo, hi); }
  void block_unordered(int64_t i, fVec& lo, fVec& hi) const {
    load_block_unordered(x + i, lo, hi);
  }
  float at(int64_t i) const { return static_cast<float>(x[i]); }
};

template <typename T>
struct SumOf {
  const T* x;
  const T* r;
  void block(int64_t i, fVec& lo, fVec& hi) const {
    fVec r_lo, r_hi;
    load_block(x + i, lo, hi);
    load_block(r + i, r_lo, r_hi);
    lo = lo + r_lo, hi = hi + r_hi;
  }
  // The same pairs of x and r, in load_block_unordered's order.
  void block_unordered(int64_t i, fVec& lo, fVec& hi) const {
    fVec r_lo, r_hi;
    load_block_unordered(x + i, lo, hi);
    load_block_unordered(r + i, r_lo, r_hi);
    lo = lo + r_lo, hi = hi + r_hi;
  }
  float at(int64_t i) const { return static_cast<float>(x[i]) + static_cast<float>(r[i]); }
};

// Sum of squares of a row (RowOf, SumOf) with four independent accumulators: several FMAs in
// flight instead of one dependent chain. The same order for every T, so an fp32 copy of a row
// sums bit for bit alike.
template <typename Row>
float fast_sum_sq_of(const Row& row, int64_t n) {
  fVec acc0(0.f), acc1(0.f), acc2(0.f), acc3(0.f);
  int64_t i = 0;
  for (; i + 2 * kBlock <= n; i += 2 * kBlock) {
    fVec a, b, c, d;
    row.block(i, a, b);
    row.block(i + kBlock, c, d);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
    acc2 = at::vec::fmadd(c, c, acc2);
    acc3 = at::vec::fmadd(d, d, acc3);
  }
  if (i + kBlock <= n) {
    fVec a, b;
    row.block(i, a, b);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
    i += kBlock;
  }
  float sum_sq = at::vec::vec_reduce_all<float>(
      [](const fVec& u, const fVec& v) { return u + v; }, (acc0 + acc1) + (acc2 + acc3));
  for (; i < n; ++i) {
    const float v = row.at(i);
    sum_sq += v * v;
  }
  return sum_sq;
}

template <typename T>
float fast_sum_sq(const T* x, int64_t n) {
  return fast_sum_sq_of(RowOf<T>{x}, n);
}

// Passes over x per row (the `passes` argument): "two" reads the row for its statistics and again,
// from L1/L2, for the normalised write; "one" widens it once into a per-task fp32 row buffer that
// both steps read, so each element of a bf16/fp16 row is converted once. Same results bit for bit.
enum class Passes { kTwo, kOne };

inline Passes parse_passes(c10::string_view passes, const char* op) {
  TORCH_CHECK(passes == "two" || passes == "one", op, ": passes must be two or one, got ",
              passes);
  return passes == "one" ? Passes::kOne : Passes::kTwo;
}

// x's row as fp32 in `buffer` (n floats).
template <typename T>
inline void widen_row(const T* x, float* buffer, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    fVec lo, hi;
    load_block(x + i, lo, hi);
    lo.store(buffer + i);
    hi.store(buffer + i + fVec::size());
  }
  for (; i < n; ++i) {
    buffer[i] = static_cast<float>(x[i]);
  }
}

// parallel_for's grain (the fewest rows a task gets): rows_per_task, raised so that a task covers
// at least task_bytes of x (the `task_bytes` argument; 0: rows only). With short rows this keeps
// small inputs on fewer threads than a row count alone would wake.
inline int64_t grain_rows(int64_t rows_per_task, int64_t task_bytes, int64_t row_bytes) {
  const int64_t by_bytes = row_bytes > 0 ? (task_bytes + row_bytes - 1) / row_bytes : 1;
  return std::max(rows_per_task, by_bytes);
}

inline void check_task_bytes(int64_t task_bytes, const char* op) {
  TORCH_CHECK(task_bytes >= 0, op, ": task_bytes must be >= 0, got ", task_bytes);
}

// Rows a kernel may normalise together (the `row_group` argument: 1 or this), sharing each load
// of the weight (and bias) between them; kGroup rows of the largest hidden sizes still fit in L2.
constexpr int64_t kRowGroup = 4;

inline void check_row_group(int64_t row_group, const char* op) {
  TORCH_CHECK(row_group == 1 || row_group == kRowGroup, op, ": row_group must be 1 or ",
              kRowGroup, ", got ", row_group);
}

// Stride between consecutive rows when every leading dim steps uniformly over rows (true for
// contiguous tensors and for views such as x[..., :h] or x[::2]), so those need no copy.
inline std::optional<int64_t> uniform_row_stride(const at::Tensor& x) {
  const int64_t last = x.dim() - 1;
  if (x.size(last) > 1 && x.stride(last) != 1) {
    return std::nullopt;
  }
  std::optional<int64_t> row_stride;
  int64_t expected = 0;
  for (int64_t d = last - 1; d >= 0; --d) {
    if (x.size(d) == 1) {
      continue;
    }
    if (!row_stride) {
      row_stride = x.stride(d);
    } else if (x.stride(d) != expected) {
      return std::nullopt;
    }
    expected = x.stride(d) * x.size(d);
  }
  return row_stride.value_or(x.size(last));
}

inline bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// A 1-D parameter (weight, bias) as fp32, plus `offset` (Gemma's `1 + weight`, added in fp32 as
// Gemma does): the tensor's own data when it is fp32 already and offset is 0, else widened once
// into `storage`. It is tiny next to x, and one fp32 load in the hot loop is cheap. The storage
// is not zeroed first and is widened in vector blocks: at one row a call, zeroing and widening
// weight and bias element by element cost as much as normalising the row.
inline const float* widen_to_float(const at::Tensor& contiguous,
                                   std::unique_ptr<float[]>& storage, float offset = 0.f) {
  if (contiguous.scalar_type() == at::kFloat && offset == 0.f) {
    return contiguous.const_data_ptr<float>();
  }
  const int64_t n = contiguous.numel();
  storage.reset(new float[n]);
  AT_DISPATCH_V2(contiguous.scalar_type(), "fusionlab_widen_to_float", AT_WRAP([&] {
    const scalar_t* src = contiguous.const_data_ptr<scalar_t>();
    const fVec shift(offset);
    int64_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
      fVec lo, hi;
      load_block(src + i, lo, hi);
      (lo + shift).store(storage.get() + i);
      (hi + shift).store(storage.get() + i + fVec::size());
    }
    for (; i < n; ++i) {
      storage[i] = static_cast<float>(src[i]) + offset;
    }
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return storage.get();
}

// Rounds fp32 values to T and back (round to nearest even), as `.to(T)` between two ATen ops
// does: how the "llama" casting mode rounds the normalised row before the weight multiply.
template <typename T>
inline void round_block(fVec& lo, fVec& hi) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
  }
}

template <typename T>
inline float round_scalar(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Whether autograd must record this call: grad mode is on and some input requires grad.
template <typename... Ts>
inline bool needs_grad(const Ts&... tensors) {
  return at::GradMode::is_enabled() && (tensors.requires_grad() || ...);
}

// The casting modes of fusionlab/numerics.py: "none" and "gemma" compute in fp32 and round once;
// "llama" rounds the normalised row to x's dtype before multiplying by the weight.
inline bool rounds_normed(c10::string_view casting, const char* op) {
  TORCH_CHECK(casting == "none" || casting == "llama" || casting == "gemma", op,
              ": casting must be none, llama or gemma, got ", casting);
  return casting == "llama";
}

}  // namespace fusionlab_cpu
