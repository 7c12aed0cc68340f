// Decode attention over a paged KV cache on CPU: one new query token per sequence, keys and
// values read in place from their cache blocks (no gather), softmax computed block by block
// with a running max and sum. Registered as torch.ops.splittts_kernels.paged_attention_decode.
//
// Layouts: q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; seq_lens [B] int32
// (cached tokens including the new one); block_tables [B, max_blocks] int32. Query head h
// reads KV head h / (H / Hkv). A work item is one sequence and a run of its KV heads with all
// their query heads, so every key and value row is read from memory once, in address order
// within a block. Accumulation is fp32; bf16 inputs are widened as they are read, except where
// the CPU has AVX-512 BF16 and the head size is 64 or 128: there q.k is the CPU's bf16 dot
// product (pairs multiplied exactly, summed in fp32) on the rows as stored, and values are
// widened in registers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>

#include "cpu_math.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SPLITTTS_BF16_DOT 1
#endif

#include <algorithm>
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
  float* rows;     // [kv_heads, D] one token's keys or values widened to fp32 (bf16 only)

  static int64_t scratch_size(int64_t dim, int64_t heads, int64_t kv_heads, int64_t block_size) {
    return heads * (2 * dim + block_size + 2) + kv_heads * dim;
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

  const scalar_t* q_rows;  // [heads, D] the queries as given
  float q_scale;

  // bf16 rows with a head size the bf16 dot products take whole (SPLITTTS_BF16_DOT)
  static constexpr bool kBf16Dot =
#if defined(SPLITTTS_BF16_DOT)
      std::is_same_v<scalar_t, c10::BFloat16> && kDim > 0 && kDim % 32 == 0;
#else
      false;
#endif

  void start(const scalar_t* q, float scale) {
    q_rows = q;
    q_scale = scale;
    if constexpr (!kBf16Dot) store(qf, widen(q, qf, heads * d()), scale, heads * d());
    std::fill(acc, acc + heads * d(), 0.f);
    std::fill(run_max, run_max + heads, -std::numeric_limits<float>::infinity());
    std::fill(run_sum, run_sum + heads, 0.f);
  }

  // The first n tokens of one cache block; next_k/next_v: the next block, prefetched meanwhile.
  void block(const scalar_t* k, const scalar_t* v, int64_t n, bool first, const scalar_t* next_k,
             const scalar_t* next_v) {
    const int64_t D = d();
    const int64_t row_bytes = kv_heads * D * int64_t(sizeof(scalar_t));
    if constexpr (kBf16Dot) {
      scores_bf16(k, n, next_k, row_bytes);
    } else {
      for (int64_t t = 0; t < n; ++t) {
        prefetch(next_k + t * token_stride, row_bytes);
        const float* keys = widen(k + t * token_stride, rows, kv_heads * D);
        for (int64_t j = 0, h = 0; j < kv_heads; ++j)
          for (int64_t g = 0; g < group; ++g, ++h) probs[h * block_size + t] = dot(qf + h * D, keys + j * D, D);
      }
    }
    softmax_step(n, first);
    if constexpr (kBf16Dot) {
      accumulate_bf16(v, n, next_v, row_bytes);
    } else {
      for (int64_t t = 0; t < n; ++t) {
        prefetch(next_v + t * token_stride, row_bytes);
        const float* values = widen(v + t * token_stride, rows, kv_heads * D);
        for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
          const float* row = values + j * D;
          for (int64_t g = 0; g < group; ++g, ++h) {
            const float weight = probs[h * block_size + t];
            float* a = acc + h * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) a[i] += weight * row[i];
          }
        }
      }
    }
  }

#if defined(SPLITTTS_BF16_DOT)
  // scores[h, t] = scale * q[h] . k[t, h / group], 32 pairs of bf16 per instruction; token by
  // token, each key row read once in address order
  void scores_bf16(const c10::BFloat16* k, int64_t n, const c10::BFloat16* next_k, int64_t row_bytes) {
    constexpr int64_t V = kDim / 32;
    for (int64_t t = 0; t < n; ++t) {
      prefetch(next_k + t * token_stride, row_bytes);
      const c10::BFloat16* keys = k + t * token_stride;
      for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
        __m512bh kv[V];
        for (int64_t i = 0; i < V; ++i) kv[i] = (__m512bh)_mm512_loadu_si512(keys + j * kDim + 32 * i);
        for (int64_t g = 0; g < group; ++g, ++h) {
          __m512 sum = _mm512_setzero_ps();
          for (int64_t i = 0; i < V; ++i)
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q_rows + h * kDim + 32 * i), kv[i]);
          probs[h * block_size + t] = _mm512_reduce_add_ps(sum) * q_scale;
        }
      }
    }
  }

  // acc[h] += sum over t of probs[h, t] * v[t, h / group]: token by token, each value row
  // widened once, in registers, for its KV head's whole query group
  void accumulate_bf16(const c10::BFloat16* v, int64_t n, const c10::BFloat16* next_v, int64_t row_bytes) {
    constexpr int64_t W = kDim / 16;  // fp32 vectors per row
    for (int64_t t = 0; t < n; ++t) {
      prefetch(next_v + t * token_stride, row_bytes);
      const c10::BFloat16* values = v + t * token_stride;
      for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
        __m512 x[W];
        for (int64_t i = 0; i < W; ++i)
          x[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(values + j * kDim + 16 * i))), 16));
        for (int64_t g = 0; g < group; ++g, ++h) {
          const __m512 w = _mm512_set1_ps(probs[h * block_size + t]);
          float* a = acc + h * kDim;
          for (int64_t i = 0; i < W; ++i)
            _mm512_storeu_ps(a + 16 * i, _mm512_fmadd_ps(w, x[i], _mm512_loadu_ps(a + 16 * i)));
        }
      }
    }
  }
#else
  void scores_bf16(const scalar_t*, int64_t, const scalar_t*, int64_t) {}
  void accumulate_bf16(const scalar_t*, int64_t, const scalar_t*, int64_t) {}
#endif

  // The block's scores become probabilities against the running max; what was accumulated
  // under an older max is scaled down to the new one.
  void softmax_step(int64_t n, bool first) {
    const int64_t D = d();
    for (int64_t h = 0; h < heads; ++h) {
      float* p = probs + h * block_size;
      float block_max = run_max[h];
#pragma omp simd reduction(max : block_max)
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, p[t]);
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) p[t] = exp_nonpositive(p[t] - block_max);
      if (block_max != run_max[h]) {
        // the first block finds run_max = -inf and nothing accumulated yet
        const float correction = first ? 0.f : exp_nonpositive(run_max[h] - block_max);
        float* a = acc + h * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) a[i] *= correction;
        run_sum[h] *= correction;
        run_max[h] = block_max;
      }
      run_sum[h] += sum(p, n);
    }
  }

  void finish(scalar_t* out) const {
    for (int64_t h = 0; h < heads; ++h) store(out + h * d(), acc + h * d(), 1.f / run_sum[h], d());
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
  std::vector<float> scratch(team * per_thread);

#pragma omp parallel num_threads(int(team)) if (team > 1)
  {
    Item<scalar_t, kDim> item{head_dim, heads, group, kv_per_item, block_size, token_stride};
    item.attach(scratch.data() + omp_get_thread_num() * per_thread);
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
}

TORCH_LIBRARY_IMPL(splittts_kernels, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
}
