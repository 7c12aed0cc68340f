// fp32 projections y = x W^T (+ b) on AVX-512 FMA (or AVX2 FMA), with the weight streamed from
// memory while the multiplies run.
//
// fp32 projections are bound by the CPU's multiply-adds from about 16 rows on, but oneDNN's packed
// matmul on an Intel Xeon (AMX, 2 MB L2) read its weights and multiplied them one after the other:
// 72 ms for the benchmark model's 49 projections at 64 rows (277 GFLOP/s), where the same call
// with the weight in cache reached 350-375. Here the weight is packed once, at load, as panels of
// 32 outputs, `[out/32, in, 32]`: a panel is one sequential stream of 128-byte rows, one per input
// index. Threads split the panels; while a thread computes one unit of panels it prefetches the
// next into L2 a line at a time, spread over the unit's row blocks. A row block holds 28 fp32
// accumulators:
// - up to 8 rows (a decode of a few sequences, bound by memory): one block of all rows x one
//   panel, so every weight row is loaded once; per input index two panel loads, a broadcast per
//   row, two multiply-adds per row;
// - more rows (bound by the multiplies): blocks of 7 rows x a pair of panels (four vectors), half
//   the broadcasts per multiply-add. On an AMD EPYC (Zen 4, 1 MB L2) blocks of 13-14 rows x one
//   panel ran at 168-177 GFLOP/s where 7 x 4 vectors ran at 212-224, above oneDNN's 197-212.
// Rows are taken in chunks whose input stays in L2 (a prefill's thousands), the row blocks of a
// chunk as even as the rows allow.
//
// On a CPU with AVX2 alone (an AMD Zen 3: 16 vector registers of 8 floats) the same packed weight
// is read half a panel at a time, 16 outputs (two vectors, one 64-byte line of each 128-byte row),
// in blocks of up to 6 rows: 12 accumulators, two panel loads and a broadcast per row for each
// input index, the classic 6 x 16 register block. Up to 6 rows (a decode) each weight line is
// loaded once; the next panel is prefetched while both halves of this one are computed. With one
// chain a vector, a lone row (the speech LM's decode of one sequence) waits on the multiply-add's
// latency, about 6 cycles an input index; so each output is summed in four chains over four
// segments of K, run side by side for one row, in pairs for two or three rows, and folded in one
// order whatever the rows. Each block size is a function of its own (noinline): with every size
// inlined into one body (gcc 12), a 6-row block took twice as long as a 5-row one, and the
// benchmark model's projections ran at 66-73 GFLOP/s from 48 rows on two threads where they now
// run at 150-166, above oneDNN's 127-152; so AVX2 takes every fp32 weight, as AVX-512 does.
//
// Products are summed in fp32 in input order (AVX-512: per output, one multiply-add chain;
// AVX2: per segment): the same arithmetic as any fp32 matmul, in another order. Neither order
// depends on the other rows of the call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SPLITTTS_FP32_DENSE 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPLITTTS_FP32_DENSE_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 32;           // outputs per panel: two vectors of 16
// Rows per register block: up to 8 rows x one panel where all rows fit one block (each weight row
// is loaded once: the memory-bound decode), else 7 rows x a pair of panels, 28 accumulators of
// the 32 (half the broadcasts per multiply-add: the compute-bound rest)
constexpr int64_t kSingleRows = 8;
constexpr int64_t kPairRows = 7;
constexpr int64_t kChunkBytes = 1 << 20;  // input rows held in L2 at once

bool fp32_linear_available() {
#if defined(SPLITTTS_FP32_DENSE) || defined(SPLITTTS_FP32_DENSE_AVX2)
  return true;
#else
  return false;
#endif
}

// Which form the build took: "avx512", "avx2", or "" where none.
std::string fp32_linear_form() {
#if defined(SPLITTTS_FP32_DENSE)
  return "avx512";
#elif defined(SPLITTTS_FP32_DENSE_AVX2)
  return "avx2";
#else
  return "";
#endif
}

// [N, K] -> [N/32, K, 32]: (panel, input index, output in panel).
at::Tensor fp32_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kFloat,
                   "fp32_pack_linear_weight: weight must be float32, got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) % kPanel == 0 && weight.size(1) > 0 &&
                        weight.device().is_cpu(),
                    "fp32_pack_linear_weight: weight must be a cpu [out, in] tensor with out a "
                    "multiple of 32, got sizes ",
                    weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  return weight.contiguous().view({n / kPanel, kPanel, k}).transpose(1, 2).contiguous();
}

#ifdef SPLITTTS_FP32_DENSE
// R rows x V vectors of 16 outputs: V = 4 is a pair of panels (p0, p1), V = 2 one panel (p0).
// Prefetches `lines` lines from `ahead` into L2 every `every` input indices.
template <int R, int V>
inline void rows_block(const float* x, int64_t k_dim, const float* p0, const float* p1, float* y,
                       int64_t ldy, const float* bias, const char*& ahead, int64_t every,
                       int64_t lines) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    if (k % every == 0)
      for (int64_t i = 0; i < lines; ++i, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
    __m512 b[V];
    b[0] = _mm512_loadu_ps(p0 + k * kPanel);
    b[1] = _mm512_loadu_ps(p0 + k * kPanel + 16);
    if constexpr (V == 4) {
      b[2] = _mm512_loadu_ps(p1 + k * kPanel);
      b[3] = _mm512_loadu_ps(p1 + k * kPanel + 16);
    }
#pragma GCC unroll 16  // every row: acc must stay in registers
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * k_dim + k]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const __m512 c = bias ? _mm512_loadu_ps(bias + v * 16) : _mm512_setzero_ps();
    // the second panel's outputs follow the first's in y and in the bias
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy + v * 16, _mm512_add_ps(acc[r][v], c));
  }
}

// rows_block for a row count known only at run time (1 to kPairRows or kSingleRows)
template <int V, int R = (V == 4 ? kPairRows : kSingleRows)>
inline void rows_any(int64_t rows, const float* x, int64_t k_dim, const float* p0, const float* p1,
                     float* y, int64_t ldy, const float* bias, const char*& ahead, int64_t every,
                     int64_t lines) {
  if constexpr (R > 0) {
    if (rows == R) return rows_block<R, V>(x, k_dim, p0, p1, y, ldy, bias, ahead, every, lines);
    return rows_any<V, R - 1>(rows, x, k_dim, p0, p1, y, ldy, bias, ahead, every, lines);
  }
}
#endif

#ifdef SPLITTTS_FP32_DENSE_AVX2
constexpr int64_t kHalf = 16;      // outputs of half a panel: two vectors of 8
constexpr int64_t kAvx2Rows = 6;   // rows per block: 12 accumulators of the 16 registers
constexpr int kSegments = 4;       // each output sums K in four runs, folded in a fixed order

// R rows x half a panel (16 outputs at `p`, rows of the panel kPanel floats apart). Each output
// sums its products in four chains, one per segment of K (segment s: input indices
// [s * len, (s + 1) * len), the last also the K % 4 after), folded as ((s0 + s1) + s2) + s3
// (+ bias) whatever R is: one row runs its four chains side by side (eight accumulators, which
// hide the multiply-add's latency where one chain a vector waits on it), two or three rows two
// at a time, more rows one at a time with the partial sums kept in y. So a sequence's outputs do
// not depend on how many rows share its call. Prefetches `lines_per_block` lines from `ahead`
// into L2, spread over the steps.
template <int R>
__attribute__((noinline)) void half_block(const float* x, int64_t k_dim, const float* p, float* y,
                                          int64_t ldy, const float* bias, const char*& ahead,
                                          int64_t lines_per_block) {
  constexpr int G = R == 1 ? 4 : (R <= 3 ? 2 : 1);  // segments side by side
  const int64_t len = k_dim / kSegments;
  const int64_t steps = std::max<int64_t>(1, len * (kSegments / G));
  const int64_t every = std::max<int64_t>(1, steps / std::max<int64_t>(1, lines_per_block));
  const int64_t lines = (lines_per_block + steps - 1) / steps;
  for (int s0 = 0; s0 < kSegments; s0 += G) {
    __m256 acc[G][R][2];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[g][r][0] = acc[g][r][1] = _mm256_setzero_ps();
    // steps in runs of `every`, a prefetch before each (no division per step)
    for (int64_t j0 = 0; j0 < len; j0 += every) {
      for (int64_t i = 0; i < lines; ++i, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
      const int64_t j1 = std::min(len, j0 + every);
      for (int64_t j = j0; j < j1; ++j) {
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const int64_t k = (s0 + g) * len + j;
          const __m256 b0 = _mm256_loadu_ps(p + k * kPanel);
          const __m256 b1 = _mm256_loadu_ps(p + k * kPanel + 8);
#pragma GCC unroll 8  // every row: acc must stay in registers
          for (int r = 0; r < R; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * k_dim + k);
            acc[g][r][0] = _mm256_fmadd_ps(a, b0, acc[g][r][0]);
            acc[g][r][1] = _mm256_fmadd_ps(a, b1, acc[g][r][1]);
          }
        }
      }
    }
    if (s0 + G == kSegments) {
      for (int64_t k = kSegments * len; k < k_dim; ++k) {  // the last segment's K % 4
        const __m256 b0 = _mm256_loadu_ps(p + k * kPanel);
        const __m256 b1 = _mm256_loadu_ps(p + k * kPanel + 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_broadcast_ss(x + r * k_dim + k);
          acc[G - 1][r][0] = _mm256_fmadd_ps(a, b0, acc[G - 1][r][0]);
          acc[G - 1][r][1] = _mm256_fmadd_ps(a, b1, acc[G - 1][r][1]);
        }
      }
    }
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      const __m256 c = bias ? _mm256_loadu_ps(bias + v * 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* out = y + r * ldy + v * 8;
        __m256 t = s0 == 0 ? acc[0][r][v] : _mm256_add_ps(_mm256_loadu_ps(out), acc[0][r][v]);
#pragma GCC unroll 4
        for (int g = 1; g < G; ++g) t = _mm256_add_ps(t, acc[g][r][v]);
        _mm256_storeu_ps(out, s0 + G == kSegments ? _mm256_add_ps(t, c) : t);
      }
    }
  }
}

// half_block for a row count known only at run time (1 to kAvx2Rows)
template <int R = kAvx2Rows>
inline void half_any(int64_t rows, const float* x, int64_t k_dim, const float* p, float* y,
                     int64_t ldy, const float* bias, const char*& ahead, int64_t lines_per_block) {
  if constexpr (R > 0) {
    if (rows == R) return half_block<R>(x, k_dim, p, y, ldy, bias, ahead, lines_per_block);
    return half_any<R - 1>(rows, x, k_dim, p, y, ldy, bias, ahead, lines_per_block);
  }
}

void fp32_linear_avx2(const float* X, const float* W, const float* B, float* Y, int64_t rows,
                      int64_t k, int64_t panels) {
  const int64_t n = panels * kPanel;
  const int64_t chunk = std::max<int64_t>(kAvx2Rows, kChunkBytes / (k * 4));
  const int64_t panel_lines = k * kPanel * 4 / 64;  // a panel's k 128-byte rows
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
      const int64_t c_rows = std::min(chunk, rows - c0);
      const int64_t blocks = (c_rows + kAvx2Rows - 1) / kAvx2Rows;
      // the next panel's lines, spread over this panel's two halves' blocks
      const int64_t lines_per_block = (panel_lines + 2 * blocks - 1) / (2 * blocks);
      for (int64_t p = begin; p < end; ++p) {
        const float* p0 = W + p * k * kPanel;
        // past the last panel this prefetches beyond the weight: a prefetch never faults
        const char* ahead = reinterpret_cast<const char*>(p0 + k * kPanel);
        for (int64_t half = 0; half < 2; ++half) {
          for (int64_t b = 0, r0 = c0; b < blocks; ++b) {
            // blocks as even as the rows allow: 8 rows are 4 + 4, not 6 + 2
            const int64_t r = c_rows / blocks + (b < c_rows % blocks ? 1 : 0);
            const int64_t o = p * kPanel + half * kHalf;
            half_any(r, X + r0 * k, k, p0 + half * kHalf, Y + r0 * n + o, n, B ? B + o : nullptr,
                     ahead, lines_per_block);
            r0 += r;
          }
        }
      }
    }
  });
}
#endif

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kFloat, "fp32_linear: the packed weight must be float32, got ",
                   packed.scalar_type());
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                        packed.device().is_cpu(),
                    "fp32_linear: the weight must come from fp32_pack_linear_weight, got sizes ",
                    packed.sizes());
  const int64_t panels = packed.size(0), k = packed.size(1), n = panels * kPanel;
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "fp32_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k && x.is_contiguous() && x.device().is_cpu(),
                    "fp32_linear: x must be a contiguous [rows, ", k, "] cpu tensor, got sizes ",
                    x.sizes());
  at::Tensor bias_c;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "fp32_linear: bias must be [", n,
                      "], got sizes ", bias->sizes());
    bias_c = bias->to(at::kFloat).contiguous();
  }
  TORCH_CHECK(fp32_linear_available(), "fp32_linear: this build has neither AVX-512 nor AVX2");
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, n}, x.options());
#ifdef SPLITTTS_FP32_DENSE_AVX2
  if (rows > 0)
    fp32_linear_avx2(x.const_data_ptr<float>(), packed.const_data_ptr<float>(),
                     bias_c.defined() ? bias_c.const_data_ptr<float>() : nullptr,
                     y.mutable_data_ptr<float>(), rows, k, panels);
#endif
#ifdef SPLITTTS_FP32_DENSE
  if (rows == 0) return y;
  const float* X = x.const_data_ptr<float>();
  const float* W = packed.const_data_ptr<float>();
  const float* B = bias_c.defined() ? bias_c.const_data_ptr<float>() : nullptr;
  float* Y = y.mutable_data_ptr<float>();
  const bool pairs = rows > kSingleRows;
  const int64_t width = pairs ? 2 : 1, block_rows = pairs ? kPairRows : kSingleRows;
  const int64_t chunk = std::max<int64_t>(block_rows, kChunkBytes / (k * 4));
  const int64_t unit_lines = width * k * kPanel * 4 / 64;  // a unit's panels of k 128-byte rows
  at::parallel_for(0, (panels + width - 1) / width, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
      const int64_t c_rows = std::min(chunk, rows - c0);
      const int64_t blocks = (c_rows + block_rows - 1) / block_rows;
      // the next unit's lines, spread over this unit's blocks and input indices
      const int64_t lines_per_block = (unit_lines + blocks - 1) / blocks;
      const int64_t every = std::max<int64_t>(1, k / lines_per_block);
      const int64_t lines = (lines_per_block + k - 1) / k;  // more than one where a block is short
      for (int64_t u = begin; u < end; ++u) {
        const int64_t p = width * u;
        const bool pair = pairs && p + 1 < panels;  // an odd last panel goes alone
        const float* p0 = W + p * k * kPanel;
        // a pair's panels lie one after the other, and so does the next unit
        // (past the last unit this prefetches beyond the weight: a prefetch never faults)
        const char* ahead = reinterpret_cast<const char*>(p0 + width * k * kPanel);
        for (int64_t b = 0, r0 = c0; b < blocks; ++b) {
          // blocks as even as the rows allow: 64 rows are 10 blocks of 7 or 6, not 9 x 7 + 1
          const int64_t r = c_rows / blocks + (b < c_rows % blocks ? 1 : 0);
          float* y = Y + r0 * n + p * kPanel;
          const float* bias_p = B ? B + p * kPanel : nullptr;
          if (pair)
            rows_any<4>(r, X + r0 * k, k, p0, p0 + k * kPanel, y, n, bias_p, ahead, every, lines);
          else
            rows_any<2>(r, X + r0 * k, k, p0, nullptr, y, n, bias_p, ahead, every, lines);
          r0 += r;
        }
      }
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splittts_kernels, m) {
  m.def("fp32_linear_available() -> bool", &fp32_linear_available);
  m.def("fp32_linear_form() -> str", &fp32_linear_form);
  m.def("fp32_pack_linear_weight(Tensor weight) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(splittts_kernels, CPU, m) {
  m.impl("fp32_pack_linear_weight", &fp32_pack_linear_weight);
  m.impl("fp32_linear", &fp32_linear);
}
