// bf16 projections y = x W^T (+ b) on Intel AMX, for the row counts of decoding (1-64) at the rate
// memory delivers the weights.
//
// At decode batch sizes a projection reads each weight once and does a few dozen multiply-adds
// with it, so its time is the time to stream the weights. The weight is packed once, at load, in
// the order the tile multiply reads it: for each pair of 16-output blocks and each 32-wide slice of
// the input dim, two 16 x 32 tiles (16 pairs of k, 16 outputs each, the pair innermost: the layout
// `tdpbf16ps` takes its second operand in), 2 KiB in all. So a projection is one sequential stream,
// split across torch's intra-op threads by output pairs; while a pair is computed, the next pair's
// weights are prefetched into L2. A pair is computed 32 rows at a time: 2 x 2 fp32 accumulator
// tiles, two weight tiles and two input tiles, the eight tiles AMX has; for more rows the pair's
// weights come again, from L2. Rows are padded to a multiple of 16 in a copy of the input, and
// taken in chunks that fit in L2. Products are summed in fp32 and rounded to bf16 to nearest even.
//
// On the project's Xeon (2 cores, `python -m bench.amx_linear`) this reads the benchmark model's
// weights 1.15-1.3x faster than oneDNN's packed matmul for 1-64 rows; from about 128 rows on (a
// prefill) oneDNN's is faster, by 1.15-1.25x at 256 rows.
//
// Built only where the compiler targets AMX (`-march=native` on a CPU with it); elsewhere
// `amx_linear_available` is false and the callers keep oneDNN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SPLITTTS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kBlock = 16;                     // outputs per tile, rows per tile
constexpr int64_t kSlice = 32;                     // input dim per tile (16 pairs of bf16)
constexpr int64_t kTileElems = kBlock * kSlice;    // 512 bf16, 1 KiB
constexpr int64_t kPairElems = 2 * kTileElems;     // one k-slice of an output pair
constexpr int64_t kChunkBytes = 512 << 10;         // input rows held in L2 at once

void check_weight(const at::Tensor& packed, const char* op) {
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kBFloat16, op,
                   ": the packed weight must be bfloat16, got ", packed.scalar_type());
  TORCH_CHECK_VALUE(packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == kBlock &&
                        packed.size(4) == kSlice && packed.is_contiguous() && packed.device().is_cpu(),
                    op, ": the weight must come from amx_pack_linear_weight, got sizes ",
                    packed.sizes());
}

#ifdef SPLITTTS_AMX

bool amx_permitted() {
  // Linux hands out the tile registers' state only to a process that asks for it.
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kBlock;
    config.bytes_per_row[t] = kSlice * 2;  // 64 bytes: 32 bf16 or 16 fp32
  }
  _tile_loadconfig(&config);
}

// One output pair, 16 (B = 1) or 32 (B = 2) rows: tiles 0-3 accumulate (row block m, output
// block j) in tile 2m + j, tiles 4-5 hold the pair's weights, tiles 6-7 the rows.
template <int B>
inline void pair_rows(const uint16_t* x, int64_t x_row_bytes, const uint16_t* w, int64_t slices,
                      const char*& ahead, int64_t ahead_step, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (B == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_row = x_row_bytes / 2;
  for (int64_t s = 0; s < slices; ++s) {
    const uint16_t* ws = w + s * kPairElems;
    for (int64_t line = 0; line < ahead_step; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    ahead += ahead_step;
    const uint16_t* xs = x + s * kSlice;
    _tile_loadd(4, ws, 64);
    _tile_loadd(6, xs, x_row_bytes);
    _tile_dpbf16ps(0, 6, 4);
    _tile_loadd(5, ws + kTileElems, 64);
    _tile_dpbf16ps(1, 6, 5);
    if constexpr (B == 2) {
      _tile_loadd(7, xs + kBlock * x_row, x_row_bytes);
      _tile_dpbf16ps(2, 7, 4);
      _tile_dpbf16ps(3, 7, 5);
    }
  }
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 256, 64);
  if constexpr (B == 2) {
    _tile_stored(2, acc + 512, 64);
    _tile_stored(3, acc + 768, 64);
  }
}

#endif  // SPLITTTS_AMX

bool amx_linear_available() {
#ifdef SPLITTTS_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// [N, K] -> [N/32, K/32, 2, 16, 32]: (output pair, k slice, block in pair, k pair, output * 2 + k
// in pair).
at::Tensor amx_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kBFloat16,
                   "amx_pack_linear_weight: weight must be bfloat16, got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) % (2 * kBlock) == 0 &&
                        weight.size(1) % kSlice == 0,
                    "amx_pack_linear_weight: weight must be [out, in] with out a multiple of 32 "
                    "and in a multiple of 32, got sizes ",
                    weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  return weight.contiguous()
      .view({n / (2 * kBlock), 2, kBlock, k / kSlice, kBlock, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous()
      .view({n / (2 * kBlock), k / kSlice, 2, kBlock, kSlice});
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias) {
  check_weight(packed, "amx_linear");
  const int64_t pairs = packed.size(0), slices = packed.size(1);
  const int64_t n = pairs * 2 * kBlock, k = slices * kSlice;
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16, "amx_linear: x must be bfloat16, got ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k && x.is_contiguous() && x.device().is_cpu(),
                    "amx_linear: x must be a contiguous [rows, ", k, "] cpu tensor, got sizes ",
                    x.sizes());
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "amx_linear: bias must be [", n,
                      "], got sizes ", bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  TORCH_CHECK(amx_linear_available(), "amx_linear: this build or CPU has no AMX");
#ifdef SPLITTTS_AMX
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  const int64_t padded = (rows + kBlock - 1) / kBlock * kBlock;
  at::Tensor xp = x;
  if (padded != rows) {
    xp = at::zeros({padded, k}, x.options());
    xp.narrow(0, 0, rows).copy_(x);
  }
  const auto* X = reinterpret_cast<const uint16_t*>(xp.const_data_ptr());
  const auto* W = reinterpret_cast<const uint16_t*>(packed.const_data_ptr());
  const float* bias_p = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  auto* Y = reinterpret_cast<uint16_t*>(y.mutable_data_ptr());
  // Rows are taken in chunks whose input fits in L2 beside a pair's weights (a prefill's
  // thousands of rows would otherwise come from memory again for every pair); each chunk streams
  // the weights once more, which at that many rows the multiplies outlast.
  const int64_t chunk = std::max<int64_t>(2 * kBlock, kChunkBytes / (k * 2) / (2 * kBlock) * 2 * kBlock);
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float acc[4 * kBlock * kBlock];
    for (int64_t c0 = 0; c0 < padded; c0 += chunk) {
      const int64_t c1 = std::min(padded, c0 + chunk);
      // While a pair is computed, the next pair's weights are prefetched into L2, spread evenly
      // over its row groups and slices; the later groups find the pair's weights in L2 too.
      const int64_t groups = (c1 - c0 + 2 * kBlock - 1) / (2 * kBlock);
      const int64_t ahead_step = (kPairElems * 2 / groups + 63) / 64 * 64;
      for (int64_t p = begin; p < end; ++p) {
        const uint16_t* w = W + p * slices * kPairElems;
        // (past the last pair this prefetches beyond the weight: a prefetch never faults)
        const char* ahead = reinterpret_cast<const char*>(w + slices * kPairElems);
        for (int64_t r0 = c0; r0 < c1; r0 += 2 * kBlock) {
          const uint16_t* xr = X + r0 * k;
          if (c1 - r0 >= 2 * kBlock) {
            pair_rows<2>(xr, k * 2, w, slices, ahead, ahead_step, acc);
          } else {
            pair_rows<1>(xr, k * 2, w, slices, ahead, ahead_step, acc);
          }
          const int64_t live = std::min({2 * kBlock, c1 - r0, rows - r0});  // not the padding
          for (int64_t i = 0; i < live; ++i) {
            for (int j = 0; j < 2; ++j) {
              const int64_t col = (p * 2 + j) * kBlock;
              __m512 v = _mm512_load_ps(acc + ((i / kBlock) * 2 + j) * kBlock * kBlock +
                                        (i % kBlock) * kBlock);
              if (bias_p) v = _mm512_add_ps(v, _mm512_loadu_ps(bias_p + col));
              const __m256bh h = _mm512_cvtneps_pbh(v);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(Y + (r0 + i) * n + col),
                                  reinterpret_cast<const __m256i&>(h));
            }
          }
        }
      }
    }
    _tile_release();
  });
  return y;
#else
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splittts_kernels, m) {
  m.def("amx_linear_available() -> bool", &amx_linear_available);
  m.def("amx_pack_linear_weight(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(splittts_kernels, CPU, m) {
  m.impl("amx_pack_linear_weight", &amx_pack_linear_weight);
  m.impl("amx_linear", &amx_linear);
}
