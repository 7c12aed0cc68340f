// Row-wise CPU kernels that fuse what the torch reference does in several passes over memory:
// RMS norm (with the residual add), SiLU-and-multiply of a fused gate/up projection, and
// NeoX rotary embedding of q and k; and for a streamed vocoder's channels-last [B, C, 1, T]
// activations, a layer's carried input joined to its new input through a leaky ReLU, and sums
// (a residual's, a stage's mean) whose terms are such joins, read in place without joining them.
// fp32 and bf16 tensors; all arithmetic in fp32. Rows are split across torch's intra-op threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGrainElements = 1 << 16;  // below this much work one thread does it all

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return float(x); }

// fp32 to the output type. bf16: round to nearest even and NaN to the quiet NaN, as
// c10::BFloat16(float) does, but without its branches, so the loops around it vectorise (bf16
// SiLU-and-multiply ran 4.4x slower than fp32 with the constructor).
template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint16_t out = (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(rounded);
  return c10::BFloat16(out, c10::BFloat16::from_bits());
}

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), op, ": ", name, " must be on cpu, got ", x.device());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": ", name,
                   " must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous(), op, ": ", name,
                    " must be contiguous with at least one dim, got sizes ", x.sizes());
}

// The norm weight as fp32 with the offset added: (offset + w).
std::vector<float> norm_scale(const at::Tensor& weight, int64_t dim, double offset, const char* op) {
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == dim, op, ": weight must be [", dim, "], got ",
                    weight.sizes());
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const float* p = w.const_data_ptr<float>();
  std::vector<float> scale(dim);
  for (int64_t i = 0; i < dim; ++i) scale[i] = float(offset) + p[i];
  return scale;
}

// y = x * rsqrt(mean(x^2) + eps) * scale over rows of `dim`; x is read from `src`, which for the
// residual form is the fp32 sum written first.
template <typename in_t, typename out_t>
inline void norm_row(const in_t* src, out_t* dst, const float* scale, int64_t dim, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < dim; ++i) {
    const float v = to_float(src[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / float(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) dst[i] = narrow<out_t>(to_float(src[i]) * inv * scale[i]);
}

template <typename scalar_t>
void rms_norm_impl(const at::Tensor& x, const std::vector<float>& scale, float eps, at::Tensor& out) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const scalar_t* in = x.const_data_ptr<scalar_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(in + r * dim, o + r * dim, scale.data(), dim, eps);
  });
}

template <typename scalar_t>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const std::vector<float>& scale,
                       float eps, at::Tensor& out, at::Tensor& new_residual) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const scalar_t* a = x.const_data_ptr<scalar_t>();
  const scalar_t* b = residual.const_data_ptr<scalar_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  scalar_t* res = new_residual.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      // the sum is rounded to the tensor dtype first, as `x + residual` is in the reference
      for (int64_t i = 0; i < dim; ++i)
        res[r * dim + i] = narrow<scalar_t>(to_float(a[r * dim + i]) + to_float(b[r * dim + i]));
      norm_row(res + r * dim, o + r * dim, scale.data(), dim, eps);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  check_rows(x, "rms_norm", "x");
  const auto scale = norm_scale(weight, x.size(-1), offset, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat)
    rms_norm_impl<float>(x, scale, float(eps), out);
  else
    rms_norm_impl<c10::BFloat16>(x, scale, float(eps), out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, double offset) {
  check_rows(x, "add_rms_norm", "x");
  check_rows(residual, "add_rms_norm", "residual");
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
                    "add_rms_norm: residual must match x (", x.sizes(), ", ", x.scalar_type(), "), got ",
                    residual.sizes(), ", ", residual.scalar_type());
  const auto scale = norm_scale(weight, x.size(-1), offset, "add_rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor new_residual = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return {out, new_residual};
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_impl<float>(x, residual, scale, float(eps), out, new_residual);
  else
    add_rms_norm_impl<c10::BFloat16>(x, residual, scale, float(eps), out, new_residual);
  return {out, new_residual};
}

template <typename scalar_t>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t width = out.size(-1), rows = out.numel() / width;
  const scalar_t* in = x.const_data_ptr<scalar_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = in + r * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* dst = o + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) dst[i] = narrow<scalar_t>(splittts::silu(to_float(gate[i])) * to_float(up[i]));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul", "x");
  TORCH_CHECK_VALUE(x.size(-1) % 2 == 0, "silu_and_mul: x's last dim must be even (gate then up), got ",
                    x.size(-1));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat)
    silu_and_mul_impl<float>(x, out);
  else
    silu_and_mul_impl<c10::BFloat16>(x, out);
  return out;
}

// Rotate-half on the first `rot` dims of each head of one [T, heads, D] tensor (rows may be
// strided; the head dim must be contiguous) into a contiguous output.
template <typename scalar_t>
void rotary_impl(const at::Tensor& x, const int64_t* positions, const float* cache, int64_t rot,
                 at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = rot / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const scalar_t* in = x.const_data_ptr<scalar_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrainElements / (heads * dim)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + positions[t] * rot;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* src = in + t * s0 + h * s1;
        scalar_t* dst = o + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);
          dst[i] = narrow<scalar_t>(x1 * cos[i] - x2 * sin[i]);
          dst[i + half] = narrow<scalar_t>(x2 * cos[i] + x1 * sin[i]);
        }
        for (int64_t i = rot; i < dim; ++i) dst[i] = src[i];
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos_sin_cache, int64_t rotary_dim) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
                    "rotary: q and k must be [tokens, heads, head_dim] with equal tokens and head_dim, got ",
                    q.sizes(), " and ", k.sizes());
  TORCH_CHECK_VALUE(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= q.size(2),
                    "rotary: rotary_dim must be even and in (0, head_dim], got ", rotary_dim);
  TORCH_CHECK_VALUE(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == rotary_dim &&
                        cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
                    "rotary: cos_sin_cache must be contiguous float32 [positions, rotary_dim], got ",
                    cos_sin_cache.sizes(), " ", cos_sin_cache.scalar_type());
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == q.size(0) &&
                        positions.scalar_type() == at::kLong && positions.is_contiguous(),
                    "rotary: positions must be contiguous int64 [tokens], got ", positions.sizes(), " ",
                    positions.scalar_type());
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type() &&
                         (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
                     "rotary: q and k must both be float32 or bfloat16, got ", q.scalar_type(), " and ",
                     k.scalar_type());
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->stride(2) == 1, "rotary: q and k must be cpu tensors "
                      "with a contiguous head_dim");
  }
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t max_pos = cos_sin_cache.size(0);
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < max_pos, "rotary: positions[", t, "] = ", pos[t],
                      " is outside the cos/sin table of ", max_pos, " positions");
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  const float* cache = cos_sin_cache.const_data_ptr<float>();
  if (q.scalar_type() == at::kFloat) {
    rotary_impl<float>(q, pos, cache, rotary_dim, q_out);
    rotary_impl<float>(k, pos, cache, rotary_dim, k_out);
  } else {
    rotary_impl<c10::BFloat16>(q, pos, cache, rotary_dim, q_out);
    rotary_impl<c10::BFloat16>(k, pos, cache, rotary_dim, k_out);
  }
  return {q_out, k_out};
}

// Channels-last [B, C, 1, T]: each batch's T x C values lie contiguous at its batch stride.
void check_channels_last(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), op, ": ", name, " must be on cpu, got ", x.device());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": ", name,
                   " must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 4 && x.size(2) == 1 && (x.size(1) == 1 || x.stride(1) == 1) &&
                        (x.size(3) <= 1 || x.stride(3) == x.size(1)),
                    op, ": ", name, " must be [B, C, 1, T] in channels-last layout, got sizes ",
                    x.sizes(), " strides ", x.strides());
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// 32 bf16 values as two halves of fp32, and back with the CPU's own round-to-nearest-even
// (vcvtne2ps2bf16): the branch-free scalar rounding above costs about three times as much here.
inline void widen32(const c10::BFloat16* p, __m512& lo, __m512& hi) {
  const __m512i raw = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
  hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
}
inline void narrow32(c10::BFloat16* p, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
inline __m512 leaky16(__m512 v, __m512 slope) {
  return _mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NGT_UQ), v, slope);
}
#endif

template <typename scalar_t>
inline void leaky_span(const scalar_t* in, scalar_t* out, int64_t n, float slope) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m512 s = _mm512_set1_ps(slope);
    for (; i + 32 <= n; i += 32) {
      __m512 lo, hi;
      widen32(in + i, lo, hi);
      narrow32(out + i, leaky16(lo, s), leaky16(hi, s));
    }
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) {
    const float v = to_float(in[j]);
    out[j] = narrow<scalar_t>(v > 0.f ? v : v * slope);
  }
}

template <typename scalar_t>
void join_impl(const at::Tensor& first, const at::Tensor& then, float slope, at::Tensor& out) {
  const int64_t batch = out.size(0), channels = out.size(1);
  const int64_t head = first.size(3) * channels, tail = then.size(3) * channels;
  const scalar_t* a = first.const_data_ptr<scalar_t>();
  const scalar_t* b = then.const_data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, batch, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, head + tail)),
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t r = lo; r < hi; ++r) {
                       scalar_t* row = o + r * (head + tail);
                       std::copy_n(a + r * first.stride(0), head, row);
                       leaky_span(b + r * then.stride(0), row + head, tail, slope);
                     }
                   });
}

// cat([first, then], time)[..., start:] of channels-last [B, C, 1, T] tensors, in storage of
// its own: what a streamed layer carries to its next call, cut from this call's tensors without
// keeping them alive.
at::Tensor rest_of(const at::Tensor& first, const at::Tensor& then, int64_t start) {
  const int64_t head = first.size(3), total = head + then.size(3);
  start = std::clamp<int64_t>(start, 0, total);
  at::Tensor out = at::empty({then.size(0), then.size(1), 1, total - start},
                             then.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (start < head) out.narrow(3, 0, head - start).copy_(first.narrow(3, start, head - start));
  const int64_t from = std::max<int64_t>(0, start - head);
  if (from < then.size(3))
    out.narrow(3, std::max<int64_t>(0, head - start), then.size(3) - from)
        .copy_(then.narrow(3, from, then.size(3) - from));
  return out;
}

// (cat([first, leaky_relu(then, slope)], time), its last `keep` samples in storage of their own)
// in channels-last layout, in one pass over `then` (slope 1 joins it as it is). Arithmetic in
// fp32, rounded as torch rounds.
std::tuple<at::Tensor, at::Tensor> join_channels_last(const at::Tensor& first, const at::Tensor& then, double slope,
                                                      int64_t keep) {
  check_channels_last(first, "join_channels_last", "first");
  check_channels_last(then, "join_channels_last", "then");
  TORCH_CHECK_TYPE(first.scalar_type() == then.scalar_type(),
                   "join_channels_last: first and then must have one dtype, got ", first.scalar_type(),
                   " and ", then.scalar_type());
  TORCH_CHECK_VALUE(first.size(0) == then.size(0) && first.size(1) == then.size(1),
                    "join_channels_last: first and then must share batch and channels, got ",
                    first.sizes(), " and ", then.sizes());
  TORCH_CHECK_VALUE(keep >= 0, "join_channels_last: keep must be >= 0, got ", keep);
  const int64_t length = first.size(3) + then.size(3);
  at::Tensor out = at::empty({then.size(0), then.size(1), 1, length},
                             then.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (then.scalar_type() == at::kFloat)
    join_impl<float>(first, then, float(slope), out);
  else
    join_impl<c10::BFloat16>(first, then, float(slope), out);
  return {out, rest_of(out, out.narrow(3, 0, 0), length - std::min(keep, length))};
}

// A channels-last [B, C, 1, T] tensor that is `first` then `then` along time, not copied: where
// sample j of batch row r lies.
template <typename scalar_t>
struct Joined {
  const scalar_t* first;
  const scalar_t* then;
  int64_t first_stride, then_stride, head, channels;

  Joined(const at::Tensor& a, const at::Tensor& b)
      : first(a.const_data_ptr<scalar_t>()),
        then(b.const_data_ptr<scalar_t>()),
        first_stride(a.stride(0)),
        then_stride(b.stride(0)),
        head(a.size(3)),
        channels(b.size(1)) {}

  const scalar_t* at(int64_t r, int64_t j) const {
    return j < head ? first + r * first_stride + j * channels : then + r * then_stride + (j - head) * channels;
  }
};

// x rounded to scalar_t's precision and back, as a torch op on scalar_t tensors leaves it.
template <typename scalar_t>
inline float rounded(float x) {
  return to_float(narrow<scalar_t>(x));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline __m512 rounded16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
#endif

// out[i] = (((src[0][i] + src[1][i]) + src[2][i]) + ...) / divisor, each sum rounded to scalar_t
// as torch's chain of adds rounds it, then the quotient (divisor 1: no division).
template <typename scalar_t>
inline void sum_span(const std::vector<const scalar_t*>& src, scalar_t* out, int64_t n, float divisor) {
  const size_t k = src.size();
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m512 d = _mm512_set1_ps(divisor);
    for (; i + 32 <= n; i += 32) {
      __m512 lo, hi;
      widen32(src[0] + i, lo, hi);
      for (size_t s = 1; s < k; ++s) {
        __m512 blo, bhi;
        widen32(src[s] + i, blo, bhi);
        lo = _mm512_add_ps(lo, blo);
        hi = _mm512_add_ps(hi, bhi);
        if (s + 1 < k) {
          lo = rounded16(lo);
          hi = rounded16(hi);
        }
      }
      if (divisor != 1.f) {
        lo = _mm512_div_ps(rounded16(lo), d);
        hi = _mm512_div_ps(rounded16(hi), d);
      }
      narrow32(out + i, lo, hi);
    }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    const __m512 d = _mm512_set1_ps(divisor);
    for (; i + 16 <= n; i += 16) {
      __m512 acc = _mm512_loadu_ps(src[0] + i);
      for (size_t s = 1; s < k; ++s) acc = _mm512_add_ps(acc, _mm512_loadu_ps(src[s] + i));
      _mm512_storeu_ps(out + i, divisor != 1.f ? _mm512_div_ps(acc, d) : acc);
    }
  }
#endif
  for (; i < n; ++i) {
    float acc = to_float(src[0][i]);
    for (size_t s = 1; s < k; ++s) {
      acc += to_float(src[s][i]);
      if (s + 1 < k) acc = rounded<scalar_t>(acc);
    }
    if (divisor != 1.f) acc = rounded<scalar_t>(acc) / divisor;
    out[i] = narrow<scalar_t>(acc);
  }
}

// out = (sum over i of cat([firsts[i], thens[i]], time)[..., :length]) / divisor per batch row;
// one pass over the samples, split where a part passes from its `first` to its `then`.
template <typename scalar_t>
void sum_joined_impl(const std::vector<at::Tensor>& firsts, const std::vector<at::Tensor>& thens, int64_t length,
                     float divisor, at::Tensor& out) {
  std::vector<Joined<scalar_t>> parts;
  for (size_t i = 0; i < firsts.size(); ++i) parts.emplace_back(firsts[i], thens[i]);
  const int64_t batch = out.size(0), channels = out.size(1);
  std::vector<int64_t> cuts{0, length};
  for (const auto& p : parts)
    if (p.head > 0 && p.head < length) cuts.push_back(p.head);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t out_stride = out.stride(0);
  at::parallel_for(0, batch, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, length * channels)),
                   [&](int64_t lo, int64_t hi) {
                     std::vector<const scalar_t*> src(parts.size());
                     for (int64_t r = lo; r < hi; ++r)
                       for (size_t c = 0; c + 1 < cuts.size(); ++c) {
                         for (size_t s = 0; s < parts.size(); ++s) src[s] = parts[s].at(r, cuts[c]);
                         sum_span(src, o + r * out_stride + cuts[c] * channels, (cuts[c + 1] - cuts[c]) * channels,
                                  divisor);
                       }
                   });
}

void check_joined(const at::Tensor& first, const at::Tensor& then, const at::Tensor& like, int64_t length,
                  const char* op) {
  check_channels_last(first, op, "first");
  check_channels_last(then, op, "then");
  TORCH_CHECK_TYPE(first.scalar_type() == like.scalar_type() && then.scalar_type() == like.scalar_type(), op,
                   ": every tensor must have one dtype, got ", first.scalar_type(), ", ", then.scalar_type(), " and ",
                   like.scalar_type());
  TORCH_CHECK_VALUE(first.size(0) == like.size(0) && then.size(0) == like.size(0) && first.size(1) == like.size(1) &&
                        then.size(1) == like.size(1),
                    op, ": every tensor must share batch and channels, got ", first.sizes(), ", ", then.sizes(),
                    " and ", like.sizes());
  TORCH_CHECK_VALUE(first.size(3) + then.size(3) >= length, op, ": first and then hold ",
                    first.size(3) + then.size(3), " samples, fewer than the ", length, " needed");
}

// t += cat([first, then], time)[..., :T] in place, for channels-last [B, C, 1, T] tensors: a
// residual sum whose skip path is a layer's carried input followed by its new input, without
// joining the two first. Rounded as `cat(...)[..., :T] + t` rounds. Returns the rest of the join
// (from T on) in storage of its own.
at::Tensor add_joined_(at::Tensor& t, const at::Tensor& first, const at::Tensor& then) {
  check_channels_last(t, "add_joined_", "t");
  check_joined(first, then, t, t.size(3), "add_joined_");
  const std::vector<at::Tensor> firsts{first, t}, thens{then, t.narrow(3, 0, 0)};
  if (t.scalar_type() == at::kFloat)
    sum_joined_impl<float>(firsts, thens, t.size(3), 1.f, t);
  else
    sum_joined_impl<c10::BFloat16>(firsts, thens, t.size(3), 1.f, t);
  return rest_of(first, then, t.size(3));
}

// The mean of cat([firsts[i], thens[i]], time)[..., :length] over i, for channels-last
// [B, C, 1, T] tensors, summed in order and then divided, rounded as torch's `sum(...) / n`
// rounds: a stage's residual blocks averaged, each with the samples it ran ahead last call.
// Returns the mean and each join's rest (from `length` on) in storage of its own.
std::tuple<at::Tensor, std::vector<at::Tensor>> mean_joined(const std::vector<at::Tensor>& firsts,
                                                           const std::vector<at::Tensor>& thens, int64_t length) {
  TORCH_CHECK_VALUE(!firsts.empty() && firsts.size() == thens.size(),
                    "mean_joined: firsts and thens must be non-empty and of one length, got ", firsts.size(), " and ",
                    thens.size());
  TORCH_CHECK_VALUE(length >= 0, "mean_joined: length must be >= 0, got ", length);
  for (size_t i = 0; i < firsts.size(); ++i) check_joined(firsts[i], thens[i], thens[0], length, "mean_joined");
  at::Tensor out = at::empty({thens[0].size(0), thens[0].size(1), 1, length},
                             thens[0].options().memory_format(at::MemoryFormat::ChannelsLast));
  const float divisor = float(firsts.size());
  if (out.scalar_type() == at::kFloat)
    sum_joined_impl<float>(firsts, thens, length, divisor, out);
  else
    sum_joined_impl<c10::BFloat16>(firsts, thens, length, divisor, out);
  std::vector<at::Tensor> rests;
  for (size_t i = 0; i < firsts.size(); ++i) rests.push_back(rest_of(firsts[i], thens[i], length));
  return {out, rests};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splittts_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float offset) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, int rotary_dim) -> (Tensor, Tensor)");
  m.def("join_channels_last(Tensor first, Tensor then, float slope, int keep) -> (Tensor, Tensor)");
  m.def("add_joined_(Tensor(a!) t, Tensor first, Tensor then) -> Tensor");
  m.def("mean_joined(Tensor[] firsts, Tensor[] thens, int length) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(splittts_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
  m.impl("join_channels_last", &join_channels_last);
  m.impl("add_joined_", &add_joined_);
  m.impl("mean_joined", &mean_joined);
}
