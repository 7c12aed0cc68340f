// Decode attention over a paged KV cache on CPU: one new query token per sequence, keys and
// values read in place from their cache blocks (no gather), softmax computed block by block
// with a running max and sum. Registered as torch.ops.splittts_kernels.paged_attention_decode.
//
// Layouts: q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; seq_lens [B] int32
// (cached tokens including the new one); block_tables [B, max_blocks] int32. Query head h
// reads KV head h / (H / Hkv). A work item is one sequence and a run of its KV heads with all
// their query heads, so every key and value row is read from memory once, in address order
// within a block. Accumulation is fp32; bf16 inputs are widened (exactly) as they are read.
// Where the CPU has AVX-512 and the head size is 64 or 128 the work is vectorised across
// tokens as well: the scores of 16 tokens are summed across together, each KV head's values
// are accumulated in registers for its whole query group, and the softmax runs 16 tokens a
// vector.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>

#include "cpu_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define SPLITTTS_AVX512 1
#endif
#if defined(__AVX512BF16__)
#define SPLITTTS_BF16_DOT 1
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using splittts::exp_nonpositive;

// Whether bf16 scores are taken with `vdpbf16ps` on the keys as they lie (pairs of bf16
// products, exact, summed in fp32), instead of widening the keys and multiply-adding in fp32:
// on AMD's cores (Zen 4 on) the instruction runs at twice the fp32 multiply-add rate, and decode
// attention there is bound by its arithmetic (1.15 ms a 64-sequence layer call with the KV in
// L3, 1.29 from memory); Intel's cores without AMX run it at a quarter of their FMA rate.
bool bf16_dot_scores_fast() {
#if defined(SPLITTTS_BF16_DOT)
  static const bool fast = __builtin_cpu_is("amd");
  return fast;
#else
  return false;
#endif
}

// -1: bf16_dot_scores_fast() decides; 0: widened keys; 1: bf16 dot products where built. Set
// through attention_bf16_dot_scores, so that tests take both paths on one CPU.
std::atomic<int> scores_choice{-1};

bool bf16_dot_scores() {
#if defined(SPLITTTS_BF16_DOT)
  const int choice = scores_choice.load(std::memory_order_relaxed);
  return choice < 0 ? bf16_dot_scores_fast() : choice == 1;
#else
  return false;
#endif
}

// choice -1 (by the CPU), 0 or 1 as above, or 2 to leave it; returns whether bf16 scores now
// take the dot-product path.
bool attention_bf16_dot_scores(int64_t choice) {
  TORCH_CHECK_VALUE(choice >= -1 && choice <= 2, "attention_bf16_dot_scores: choice must be -1, 0, 1 or 2, got ",
                    choice);
  if (choice != 2) scores_choice.store(int(choice), std::memory_order_relaxed);
  return bf16_dot_scores();
}

// Vectors of 16, 8 and 4 floats; the compiler splits them where registers are narrower.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;

// The first `count` of 16 floats at p, zeros after them.
inline f32x16 load_lanes(const float* p, int64_t count) {
  f32x16 v = {};
  if (count >= kLanes)
    std::memcpy(&v, p, sizeof v);  // a fixed size: one vector load
  else
    std::memcpy(&v, p, count * sizeof(float));
  return v;
}

// The sum of the 16 lanes, halving the width at each step (the compiler's own reduction of
// a vectorised loop adds the lanes one by one).
inline float horizontal_sum(const f32x16& v) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
  const f32x8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
#else
  f32x8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof lo8);
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof lo8, sizeof hi8);
  const f32x8 s8 = lo8 + hi8;
  f32x4 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof lo4);
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof lo4, sizeof hi4);
  const f32x4 s4 = lo4 + hi4;
#endif
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  f32x16 sum = {};
  for (int64_t i = 0; i < n; i += kLanes) sum += load_lanes(a + i, n - i) * load_lanes(b + i, n - i);
  return horizontal_sum(sum);
}

// Sum of p[0, n).
inline float sum(const float* p, int64_t n) {
  f32x16 s = {};
  for (int64_t i = 0; i < n; i += kLanes) s += load_lanes(p + i, n - i);
  return horizontal_sum(s);
}

// n values as fp32: fp32 rows are used where they lie, bf16 rows are widened into `buffer`.
inline const float* widen(const float* src, float* /*buffer*/, int64_t /*n*/) { return src; }

inline const float* widen(const c10::BFloat16* src, float* buffer, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buffer[i] = std::bit_cast<float>(uint32_t(bits[i]) << 16);
  return buffer;
}

inline void store(float* dst, const float* src, float factor, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * factor;
}

inline void store(c10::BFloat16* dst, const float* src, float factor, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i] * factor);
}

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

#if defined(SPLITTTS_AVX512)
// 32 values of a row as two fp32 vectors: fp32 rows as they lie (values 0-15, then 16-31),
// bf16 rows as their even and their odd values (a shift and a mask, exact). The vector path
// keeps queries and outputs in this order too; finish() restores it.
inline void load32(const float* p, __m512& a, __m512& b) {
  a = _mm512_loadu_ps(p);
  b = _mm512_loadu_ps(p + 16);
}

inline void load32(const c10::BFloat16* p, __m512& a, __m512& b) {
  const __m512i x = _mm512_loadu_si512(p);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// Where value i of 32 lies in load32's order.
template <typename scalar_t>
constexpr int64_t load32_position(int64_t i) {
  return std::is_same_v<scalar_t, float> ? i : (i % 2) * 16 + i / 2;
}

// Lane t of the result: the sum of the 16 lanes of s[t] (a transpose and a sum in one).
inline __m512 sum_lanes(const __m512 s[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128 bits: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128 bits: four tokens' sums of those 4 lanes
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes 0+1 and 2+3 of two vectors
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp_nonpositive of 16 lanes, the same steps as the scalar one.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 round = _mm512_set1_ps(12582912.f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(two_n));
}

inline __mmask16 first_lanes(int64_t m) { return __mmask16((1u << m) - 1); }

// Brings the rows of the next block into L2 a few lines at a time, spread over the work on
// the current one. Loads that miss L1 (and prefetches into L1) share about 16 line fill
// buffers a core, which limits one core to about 8 GB/s; prefetches into L2 overlap with the
// arithmetic where a burst of them, or prefetches into L1, would stall it.
struct Prefetcher {
  const char* row = nullptr;
  int64_t stride = 0, row_bytes = 0, rows_left = 0, offset = 0;

  void start(const void* first_row, int64_t stride_bytes, int64_t bytes, int64_t rows) {
    row = static_cast<const char*>(first_row);
    stride = stride_bytes;
    row_bytes = bytes;
    rows_left = rows;
    offset = 0;
  }

  int64_t lines_left() const { return rows_left > 0 ? (rows_left * row_bytes - offset + 63) / 64 : 0; }

  void step(int64_t lines) {
    for (; lines > 0 && rows_left > 0; --lines) {
      _mm_prefetch(row + offset, _MM_HINT_T1);
      offset += 64;
      if (offset >= row_bytes) {
        offset = 0;
        row += stride;
        --rows_left;
      }
    }
  }
};
#endif

// One work item: query heads [0, heads), head h reading KV head h / group of the item's
// kv_heads, whose rows lie side by side in each cache token. kDim is the head size where it is
// fixed at compile time (the row loops then unroll), 0 where it is read from `dim`.
template <typename scalar_t, int64_t kDim>
struct Item {
  int64_t dim, heads, group, kv_heads, block_size, token_stride;
  float* qf;       // [heads, D] scaled queries
  float* acc;      // [heads, D] unnormalised outputs
  float* probs;    // [heads, block_size] scores, then probabilities
  float* run_max;  // [heads]
  float* run_sum;  // [heads]
  float* rows;     // [max(kv_heads, 16), D] keys widened to fp32 (bf16 only)
  const scalar_t* q_rows = nullptr;  // [heads, D] the queries as given (bf16 dot scores)
  float q_scale = 1.f;
  bool dot_scores = false;  // bf16_dot_scores(), for bf16

  static int64_t scratch_size(int64_t dim, int64_t heads, int64_t kv_heads, int64_t block_size) {
    return heads * (2 * dim + block_size + 2) + std::max<int64_t>(kv_heads, 16) * dim;
  }

  void attach(float* scratch) {
    qf = scratch;
    acc = qf + heads * dim;
    probs = acc + heads * dim;
    run_max = probs + heads * block_size;
    run_sum = run_max + heads;
    rows = run_sum + heads;
  }

  int64_t d() const { return kDim > 0 ? kDim : dim; }

  // Head sizes the vector path takes whole (SPLITTTS_AVX512).
  static constexpr bool kVector =
#if defined(SPLITTTS_AVX512)
      kDim > 0 && kDim % 32 == 0 && kDim <= 128;
#else
      false;
#endif

  void start(const scalar_t* q, float scale) {
    if constexpr (kVector) {
      start_vector(q, scale);
    } else {
      store(qf, widen(q, qf, heads * d()), scale, heads * d());
    }
    std::fill(acc, acc + heads * d(), 0.f);
    std::fill(run_max, run_max + heads, -std::numeric_limits<float>::infinity());
    std::fill(run_sum, run_sum + heads, 0.f);
  }

  // The first n tokens of one cache block; next_k/next_v: the next block, prefetched meanwhile.
  void block(const scalar_t* k, const scalar_t* v, int64_t n, bool first, const scalar_t* next_k,
             const scalar_t* next_v) {
    if constexpr (kVector) {
      block_vector(k, v, n, first, next_k, next_v);
      return;
    }
    const int64_t D = d();
    const int64_t row_bytes = kv_heads * D * int64_t(sizeof(scalar_t));
    for (int64_t t = 0; t < n; ++t) {
      prefetch(next_k + t * token_stride, row_bytes);
      const float* keys = widen(k + t * token_stride, rows, kv_heads * D);
      for (int64_t j = 0, h = 0; j < kv_heads; ++j)
        for (int64_t g = 0; g < group; ++g, ++h) probs[h * block_size + t] = dot(qf + h * D, keys + j * D, D);
    }
    softmax_step(n, first);
    for (int64_t t = 0; t < n; ++t) {
      prefetch(next_v + t * token_stride, row_bytes);
      const float* values = widen(v + t * token_stride, rows, kv_heads * D);
      for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
        const float* row = values + j * D;
        for (int64_t g = 0; g < group; ++g, ++h) {
          const float weight = probs[h * block_size + t];
          float* a = acc + h * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += weight * row[i];  // simd-checked
        }
      }
    }
  }

#if defined(SPLITTTS_AVX512)
  static constexpr int64_t kVectors = kDim / 16;  // fp32 vectors per row

  // the queries scaled, in load32's order
  Prefetcher ahead;

  void start_vector(const scalar_t* q, float scale) {
    q_rows = q;
    q_scale = scale;
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < heads * kDim; i += 32) {
      __m512 a, b;
      load32(q + i, a, b);
      _mm512_storeu_ps(qf + i, _mm512_mul_ps(a, factor));
      _mm512_storeu_ps(qf + i + 16, _mm512_mul_ps(b, factor));
    }
  }

  void block_vector(const scalar_t* k, const scalar_t* v, int64_t n, bool first, const scalar_t* next_k,
                    const scalar_t* next_v) {
    const int64_t row_bytes = kv_heads * kDim * int64_t(sizeof(scalar_t));
    const int64_t stride_bytes = token_stride * int64_t(sizeof(scalar_t));
    // the next block's keys while the scores are computed, its values while these are summed
    ahead.start(next_k, stride_bytes, row_bytes, block_size);
    for (int64_t t0 = 0; t0 < n; t0 += 16) scores_vector(k + t0 * token_stride, t0, std::min<int64_t>(16, n - t0));
    ahead.step(ahead.lines_left());
    softmax_vector(n, first);
    ahead.start(next_v, stride_bytes, row_bytes, block_size);
    // the group's heads in passes that keep their sums in registers (16 of the 32)
    const int64_t P = group % 4 == 0 && kVectors <= 4 ? 4 : group % 2 == 0 ? 2 : 1;
    const int64_t steps = kv_heads * (group / P) * n;
    const int64_t lines = (ahead.lines_left() + steps - 1) / steps;
    for (int64_t j = 0; j < kv_heads; ++j)
      for (int64_t h = j * group; h < (j + 1) * group; h += P) {
        if (P == 4) accumulate_vector<4>(v + j * kDim, h, n, lines);
        if (P == 2) accumulate_vector<2>(v + j * kDim, h, n, lines);
        if (P == 1) accumulate_vector<1>(v + j * kDim, h, n, lines);
      }
    ahead.step(ahead.lines_left());
  }

  // probs[h, t0 + t] = q[h] . k[t, h / group] for the m <= 16 tokens from k: each token's
  // products summed into a vector of its own, the 16 vectors summed across at once.
  void scores_vector(const scalar_t* k, int64_t t0, int64_t m) {
    const int64_t lines = (ahead.lines_left() + heads - 1) / heads;
#if defined(SPLITTTS_BF16_DOT)
    if constexpr (!std::is_same_v<scalar_t, float>) {
      if (dot_scores) return scores_dot(k, t0, m, lines);
    }
#endif
    for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
      // fp32 keys are read where they lie; bf16 keys are widened once for the whole group
      const float* keys;
      int64_t stride;
      if constexpr (std::is_same_v<scalar_t, float>) {
        keys = k + j * kDim;
        stride = token_stride;
      } else {
        for (int64_t t = 0; t < m; ++t)
          for (int64_t i = 0; i < kDim; i += 32) {
            __m512 a, b;
            load32(k + t * token_stride + j * kDim + i, a, b);
            _mm512_storeu_ps(rows + t * kDim + i, a);
            _mm512_storeu_ps(rows + t * kDim + i + 16, b);
          }
        keys = rows;
        stride = kDim;
      }
      for (int64_t g = 0; g < group; ++g, ++h) {
        ahead.step(lines);
        __m512 query[kVectors];
        for (int64_t i = 0; i < kVectors; ++i) query[i] = _mm512_loadu_ps(qf + h * kDim + 16 * i);
        __m512 s[16];
#pragma GCC unroll 16
        for (int64_t t = 0; t < 16; ++t) {
          // past the m tokens: the first row again, its lane not stored
          const float* row = keys + (t < m ? t : 0) * stride;
          s[t] = _mm512_mul_ps(query[0], _mm512_loadu_ps(row));
#pragma GCC unroll 8
          for (int64_t i = 1; i < kVectors; ++i) s[t] = _mm512_fmadd_ps(query[i], _mm512_loadu_ps(row + 16 * i), s[t]);
        }
        _mm512_mask_storeu_ps(probs + h * block_size + t0, first_lanes(m), sum_lanes(s));
      }
    }
  }

#if defined(SPLITTTS_BF16_DOT)
  // scores_vector with bf16 pairs: q . k summed in fp32 from exact products of the bf16 q and
  // k as they lie (any pairing of the lanes gives the same terms), then scaled
  void scores_dot(const scalar_t* k, int64_t t0, int64_t m, int64_t lines) {
    constexpr int64_t kPairs = kDim / 32;  // 512-bit vectors of 32 bf16 per row
    const __m512 factor = _mm512_set1_ps(q_scale);
    for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
      const scalar_t* keys = k + j * kDim;
      for (int64_t g = 0; g < group; ++g, ++h) {
        ahead.step(lines);
        __m512bh query[kPairs];
        for (int64_t i = 0; i < kPairs; ++i) query[i] = (__m512bh)_mm512_loadu_si512(q_rows + h * kDim + 32 * i);
        __m512 s[16];
#pragma GCC unroll 16
        for (int64_t t = 0; t < 16; ++t) {
          const scalar_t* row = keys + (t < m ? t : 0) * token_stride;  // past m: not stored
          s[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[0], (__m512bh)_mm512_loadu_si512(row));
#pragma GCC unroll 4
          for (int64_t i = 1; i < kPairs; ++i)
            s[t] = _mm512_dpbf16_ps(s[t], query[i], (__m512bh)_mm512_loadu_si512(row + 32 * i));
        }
        _mm512_mask_storeu_ps(probs + h * block_size + t0, first_lanes(m), _mm512_mul_ps(sum_lanes(s), factor));
      }
    }
  }
#endif

  // acc[h, h + P) += sum over t < n of probs[h', t] * v[t]: each value row widened once for
  // the P heads, their sums in registers for the whole block.
  template <int64_t P>
  void accumulate_vector(const scalar_t* v, int64_t h, int64_t n, int64_t lines) {
    __m512 sums[P][kVectors];
    for (int64_t p = 0; p < P; ++p)
      for (int64_t i = 0; i < kVectors; ++i) sums[p][i] = _mm512_loadu_ps(acc + (h + p) * kDim + 16 * i);
    for (int64_t t = 0; t < n; ++t) {
      ahead.step(lines);
      __m512 x[kVectors];
      for (int64_t i = 0; i < kVectors; i += 2) load32(v + t * token_stride + 16 * i, x[i], x[i + 1]);
      for (int64_t p = 0; p < P; ++p) {
        const __m512 w = _mm512_set1_ps(probs[(h + p) * block_size + t]);
        for (int64_t i = 0; i < kVectors; ++i) sums[p][i] = _mm512_fmadd_ps(w, x[i], sums[p][i]);
      }
    }
    for (int64_t p = 0; p < P; ++p)
      for (int64_t i = 0; i < kVectors; ++i) _mm512_storeu_ps(acc + (h + p) * kDim + 16 * i, sums[p][i]);
  }

  // softmax_step, 16 tokens a vector
  void softmax_vector(int64_t n, bool first) {
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t h = 0; h < heads; ++h) {
      float* p = probs + h * block_size;
      __m512 top = _mm512_set1_ps(run_max[h]);
      for (int64_t t0 = 0; t0 < n; t0 += 16)
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(minus_inf, first_lanes(std::min<int64_t>(16, n - t0)), p + t0));
      const float block_max = _mm512_reduce_max_ps(top);
      const __m512 shift = _mm512_set1_ps(block_max);
      __m512 total = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const __mmask16 lanes = first_lanes(std::min<int64_t>(16, n - t0));
        const __m512 e = _mm512_maskz_mov_ps(lanes, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, p + t0), shift)));
        _mm512_mask_storeu_ps(p + t0, lanes, e);
        total = _mm512_add_ps(total, e);
      }
      rescale(h, block_max, first);
      run_sum[h] += _mm512_reduce_add_ps(total);
    }
  }
#else
  void start_vector(const scalar_t*, float) {}
  void block_vector(const scalar_t*, const scalar_t*, int64_t, bool, const scalar_t*, const scalar_t*) {}
#endif

  // A new running max: what was accumulated under the old one is scaled down to it.
  void rescale(int64_t h, float block_max, bool first) {
    if (block_max == run_max[h]) return;
    // the first block finds run_max = -inf and nothing accumulated yet
    const float correction = first ? 0.f : exp_nonpositive(run_max[h] - block_max);
    float* a = acc + h * d();
#pragma omp simd
    for (int64_t i = 0; i < d(); ++i) a[i] *= correction;  // simd-checked
    run_sum[h] *= correction;
    run_max[h] = block_max;
  }

  // The block's scores become probabilities against the running max; what was accumulated
  // under an older max is scaled down to the new one.
  void softmax_step(int64_t n, bool first) {
    for (int64_t h = 0; h < heads; ++h) {
      float* p = probs + h * block_size;
      float block_max = run_max[h];
#pragma omp simd reduction(max : block_max)
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, p[t]);
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) p[t] = exp_nonpositive(p[t] - block_max);  // simd-checked
      rescale(h, block_max, first);
      run_sum[h] += sum(p, n);
    }
  }

  void finish(scalar_t* out) const {
    if constexpr (kVector && !std::is_same_v<scalar_t, float>) {
      // back from load32's order
      for (int64_t h = 0; h < heads; ++h) {
        const float factor = 1.f / run_sum[h];
        for (int64_t i = 0; i < kDim; ++i)
          out[h * kDim + i] = scalar_t(acc[h * kDim + i - i % 32 + load32_position<scalar_t>(i % 32)] * factor);
      }
    } else {
      for (int64_t h = 0; h < heads; ++h) store(out + h * d(), acc + h * d(), 1.f / run_sum[h], d());
    }
  }
};

template <typename scalar_t, int64_t kDim>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& seq_lens, const at::Tensor& block_tables, float scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const int64_t table_stride = block_tables.stride(0);
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.const_data_ptr<scalar_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();

  // Whole sequences read each cache block front to back; their KV heads are split only as
  // far as it takes to give every thread a few items.
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  while (chunks < num_kv_heads && batch * chunks < 4 * threads) chunks *= 2;
  while (num_kv_heads % chunks) --chunks;
  const int64_t kv_per_item = num_kv_heads / chunks;
  const int64_t num_items = batch * chunks;
  const int64_t team = std::min(threads, num_items);

  // Longest sequences first: with dynamic scheduling the short ones fill in at the end.
  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [lens](int64_t a, int64_t b) { return lens[a] > lens[b]; });

  const int64_t heads = kv_per_item * group;
  const int64_t per_thread = Item<scalar_t, kDim>::scratch_size(head_dim, heads, kv_per_item, block_size);
  const bool dot_scores = Item<scalar_t, kDim>::kVector && bf16_dot_scores();
  std::vector<float> scratch(team * per_thread);

#pragma omp parallel num_threads(int(team)) if (team > 1)
  {
    Item<scalar_t, kDim> item{head_dim, heads, group, kv_per_item, block_size, token_stride};
    item.attach(scratch.data() + omp_get_thread_num() * per_thread);
    item.dot_scores = !std::is_same_v<scalar_t, float> && dot_scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const int64_t b = order[i / chunks];
      const int64_t first_kv = (i % chunks) * kv_per_item;
      const int64_t first_row = b * num_heads + first_kv * group;  // the item's query rows are adjacent
      const int64_t len = lens[b];
      const int64_t used_blocks = (len + block_size - 1) / block_size;
      const int32_t* table = tables + b * table_stride;
      item.start(q_data + first_row * head_dim, scale);
      for (int64_t j = 0; j < used_blocks; ++j) {
        const int64_t offset = table[j] * block_stride + first_kv * head_dim;
        // after the last block, "prefetch" that block again: it is in cache already
        const int64_t next = j + 1 < used_blocks ? table[j + 1] * block_stride + first_kv * head_dim : offset;
        item.block(k_data + offset, v_data + offset, std::min(block_size, len - j * block_size), j == 0,
                   k_data + next, v_data + next);
      }
      item.finish(out_data + first_row * head_dim);
    }
  }
}

template <typename scalar_t>
void decode_any_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& seq_lens, const at::Tensor& block_tables, float scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return decode<scalar_t, 64>(q, k_cache, v_cache, seq_lens, block_tables, scale, out);
    case 128: return decode<scalar_t, 128>(q, k_cache, v_cache, seq_lens, block_tables, scale, out);
    default: return decode<scalar_t, 0>(q, k_cache, v_cache, seq_lens, block_tables, scale, out);
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& seq_lens, const at::Tensor& block_tables) {
  TORCH_CHECK_VALUE(q.dim() == 3, "paged_attention_decode: q must be [batch, num_heads, head_dim], got ",
                    q.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4,
                    "paged_attention_decode: k_cache must be [num_blocks, block_size, num_kv_heads, "
                    "head_dim], got ", k_cache.sizes());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "paged_attention_decode: v_cache shape ",
                    v_cache.sizes(), " differs from k_cache shape ", k_cache.sizes());
  TORCH_CHECK_VALUE(k_cache.size(1) > 0 && k_cache.size(2) > 0,
                    "paged_attention_decode: k_cache has no block slots or no KV heads: ", k_cache.sizes());
  TORCH_CHECK_VALUE(q.size(2) == k_cache.size(3), "paged_attention_decode: q head_dim ", q.size(2),
                    " differs from the cache head_dim ", k_cache.size(3));
  TORCH_CHECK_VALUE(q.size(1) % k_cache.size(2) == 0, "paged_attention_decode: q num_heads ", q.size(1),
                    " is not a multiple of the cache num_kv_heads ", k_cache.size(2));
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0),
                    "paged_attention_decode: seq_lens must be [batch] with batch ", q.size(0), ", got ",
                    seq_lens.sizes());
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == q.size(0),
                    "paged_attention_decode: block_tables must be [batch, max_blocks] with batch ",
                    q.size(0), ", got ", block_tables.sizes());

  const auto dtype = q.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16,
                   "paged_attention_decode: q must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK_TYPE(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
                   "paged_attention_decode: k_cache and v_cache must have q's dtype ", dtype, ", got ",
                   k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK_TYPE(seq_lens.scalar_type() == at::kInt, "paged_attention_decode: seq_lens must be int32, got ",
                   seq_lens.scalar_type());
  TORCH_CHECK_TYPE(block_tables.scalar_type() == at::kInt,
                   "paged_attention_decode: block_tables must be int32, got ", block_tables.scalar_type());

  const std::pair<const char*, const at::Tensor*> named[] = {
      {"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"seq_lens", &seq_lens},
      {"block_tables", &block_tables}};
  for (const auto& [name, tensor] : named)
    TORCH_CHECK(tensor->device().is_cpu(), "paged_attention_decode: ", name, " must be on cpu, got ",
                tensor->device());
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_decode: q, k_cache and v_cache must be contiguous");
  TORCH_CHECK(seq_lens.is_contiguous() && (block_tables.size(1) <= 1 || block_tables.stride(1) == 1),
              "paged_attention_decode: seq_lens and block_tables rows must be contiguous");

  // Validated before the parallel loop so that the loop itself cannot fail.
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1), table_stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK_VALUE(len >= 1 && len <= max_blocks * block_size, "paged_attention_decode: seq_lens[", b,
                      "] = ", len, " is outside [1, max_blocks * block_size = ", max_blocks * block_size, "]");
    for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[b * table_stride + i];
      TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "paged_attention_decode: block_tables[", b, ", ",
                        i, "] = ", block, " is not a cache block (num_blocks ", num_blocks, ")");
    }
  }
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale) {
  check_inputs(q, k_cache, v_cache, seq_lens, block_tables);
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.numel() == 0) return out;
  if (q.scalar_type() == at::kFloat)
    decode_any_dim<float>(q, k_cache, v_cache, seq_lens, block_tables, float(scale), out);
  else
    decode_any_dim<c10::BFloat16>(q, k_cache, v_cache, seq_lens, block_tables, float(scale), out);
  return out;
}

}  // namespace

TORCH_LIBRARY(splittts_kernels, m) {
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, "
        "Tensor block_tables, float scale) -> Tensor");
  m.def("attention_bf16_dot_scores(int choice) -> bool", &attention_bf16_dot_scores);
}

TORCH_LIBRARY_IMPL(splittts_kernels, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
}
