// Row-wise CPU kernels that fuse what the torch reference does in several passes over memory:
// RMS norm (with the residual add, or gated by SiLU), SiLU-and-multiply of a fused gate/up
// projection, NeoX rotary embedding of q and k (alone or after their per-head norms), Gated
// DeltaNet's delta-rule inputs (normalised q and k, decay and write gates), new keys and values
// into the paged caches; and for a streamed vocoder's channels-last [B, C, 1, T] activations, a
// layer's carried input joined to its new input through a leaky ReLU, and sums (a residual's, a
// stage's mean) whose terms are such joins, read in place without joining them, and an activation
// rounded to uint8 for an int8 convolution. fp32 and bf16 tensors; all arithmetic in fp32. Rows
// are split across torch's intra-op threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
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
    const float v = to_float(src[i]);  // simd-checked
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / float(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) dst[i] = narrow<out_t>(to_float(src[i]) * inv * scale[i]);  // simd-checked
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
      for (int64_t i = 0; i < width; ++i) dst[i] = narrow<scalar_t>(splittts::silu(to_float(gate[i])) * to_float(up[i]));  // simd-checked
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

// rms_norm(x, offset 0) * weight * silu(gate) over rows of `dim` (Gated DeltaNet's output
// norm): x contiguous [T, H, D], gate [T, H, D] with a contiguous last dim.
template <typename scalar_t>
void gated_rms_norm_impl(const at::Tensor& x, const at::Tensor& gate, const float* weight, float eps,
                         at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t g0 = gate.stride(0), g1 = gate.stride(1);
  const scalar_t* in = x.const_data_ptr<scalar_t>();
  const scalar_t* gates = gate.const_data_ptr<scalar_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, tokens * heads, std::max<int64_t>(1, kGrainElements / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* src = in + r * dim;
      const scalar_t* g = gates + (r / heads) * g0 + (r % heads) * g1;
      scalar_t* dst = o + r * dim;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += to_float(src[i]) * to_float(src[i]);  // simd-checked
      const float inv = 1.f / std::sqrt(sum / float(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i)
        dst[i] = narrow<scalar_t>(to_float(src[i]) * inv * weight[i] * splittts::silu(to_float(g[i])));  // simd-checked
    }
  });
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps) {
  check_rows(x, "gated_rms_norm", "x");
  TORCH_CHECK_VALUE(x.dim() == 3 && gate.dim() == 3 && gate.sizes() == x.sizes() && gate.stride(2) == 1 &&
                        gate.device().is_cpu(),
                    "gated_rms_norm: x and gate must be [tokens, heads, dim] of one shape, gate's last dim "
                    "contiguous, got ", x.sizes(), " and ", gate.sizes(), " strides ", gate.strides());
  TORCH_CHECK_TYPE(gate.scalar_type() == x.scalar_type(), "gated_rms_norm: gate must be ", x.scalar_type(),
                   " as x, got ", gate.scalar_type());
  const auto scale = norm_scale(weight, x.size(-1), 0.0, "gated_rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat)
    gated_rms_norm_impl<float>(x, gate, scale.data(), float(eps), out);
  else
    gated_rms_norm_impl<c10::BFloat16>(x, gate, scale.data(), float(eps), out);
  return out;
}

// Each new token's key and value rows [T, Hkv, D] (rows may be strided, the head dim
// contiguous) copied to its slot of the paged caches [blocks, block_size, Hkv, D]; tokens whose
// slot is negative are skipped.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0);
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                        v_cache.is_contiguous(),
                    "write_kv: the caches must be contiguous [blocks, block_size, heads, dim] of one shape, got ",
                    k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t heads = k_cache.size(2), dim = k_cache.size(3), slots = k_cache.size(0) * k_cache.size(1);
  for (const auto& [x, name] : {std::pair{&key, "key"}, std::pair{&value, "value"}}) {
    TORCH_CHECK_VALUE(x->device().is_cpu() && x->dim() == 3 && x->size(0) == tokens && x->size(1) == heads &&
                          x->size(2) == dim && x->stride(2) == 1 && x->stride(1) == dim,
                      "write_kv: ", name, " must be a cpu tensor [", tokens, ", ", heads, ", ", dim,
                      "] with contiguous heads, got ", x->sizes(), " strides ", x->strides());
    TORCH_CHECK_TYPE(x->scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                     "write_kv: ", name, " and the caches must share one dtype, got ", x->scalar_type(), " and ",
                     k_cache.scalar_type());
  }
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                        slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                    "write_kv: slot_mapping must be contiguous int64 [", tokens, "], got ", slot_mapping.sizes(),
                    " ", slot_mapping.scalar_type());
  const int64_t* slot = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_VALUE(slot[t] < slots, "write_kv: slot_mapping[", t, "] = ", slot[t], " is outside the cache of ",
                      slots, " slots");
  const int64_t row = heads * dim * int64_t(k_cache.element_size());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(key.const_data_ptr());
  const auto* vp = static_cast<const char*>(value.const_data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    std::memcpy(kc + slot[t] * row, kp + t * ks, row);
    std::memcpy(vc + slot[t] * row, vp + t * vs, row);
  }
}

// Rotate-half of one head's row on its first `rot` dims (cos, sin: rot / 2 each); the dims past
// `rot` are copied.
template <typename scalar_t>
inline void rotate_row(const scalar_t* src, scalar_t* dst, const float* cos, const float* sin, int64_t rot,
                       int64_t dim) {
  const int64_t half = rot / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);  // simd-checked
    dst[i] = narrow<scalar_t>(x1 * cos[i] - x2 * sin[i]);
    dst[i + half] = narrow<scalar_t>(x2 * cos[i] + x1 * sin[i]);
  }
  for (int64_t i = rot; i < dim; ++i) dst[i] = src[i];
}

// Rotary on each head of one [T, heads, D] tensor (rows may be strided; the head dim must be
// contiguous) into a contiguous output; with a norm `scale`, each head's row is RMS-normed
// first and rounded to the dtype, as the reference norm returns it.
template <typename scalar_t>
void rotary_impl(const at::Tensor& x, const int64_t* positions, const float* cache, int64_t rot,
                 at::Tensor& out, const float* scale = nullptr, float eps = 0.f) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = rot / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const scalar_t* in = x.const_data_ptr<scalar_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrainElements / (heads * dim)), [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> normed(scale != nullptr ? dim : 0);
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + positions[t] * rot;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* src = in + t * s0 + h * s1;
        if (scale != nullptr) {
          norm_row(src, normed.data(), scale, dim, eps);
          src = normed.data();
        }
        rotate_row(src, o + (t * heads + h) * dim, cos, cos + half, rot, dim);
      }
    }
  });
}

void check_rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
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
}

// Rotary of q and k, each head's row RMS-normed first where norm scales are given.
std::tuple<at::Tensor, at::Tensor> rotary_of(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& cos_sin_cache, int64_t rotary_dim,
                                             const float* q_scale = nullptr, const float* k_scale = nullptr,
                                             float eps = 0.f) {
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  const float* cache = cos_sin_cache.const_data_ptr<float>();
  if (q.scalar_type() == at::kFloat) {
    rotary_impl<float>(q, pos, cache, rotary_dim, q_out, q_scale, eps);
    rotary_impl<float>(k, pos, cache, rotary_dim, k_out, k_scale, eps);
  } else {
    rotary_impl<c10::BFloat16>(q, pos, cache, rotary_dim, q_out, q_scale, eps);
    rotary_impl<c10::BFloat16>(k, pos, cache, rotary_dim, k_out, k_scale, eps);
  }
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos_sin_cache, int64_t rotary_dim) {
  check_rotary(positions, q, k, cos_sin_cache, rotary_dim);
  return rotary_of(positions, q, k, cos_sin_cache, rotary_dim);
}

// rotary(rms_norm(q, q_weight), rms_norm(k, k_weight)) with per-head norms: Qwen3's and
// Qwen3.5's attention inputs in one pass, strided q and k read in place.
std::tuple<at::Tensor, at::Tensor> qk_norm_rotary(const at::Tensor& positions, const at::Tensor& q,
                                                  const at::Tensor& k, const at::Tensor& q_weight,
                                                  const at::Tensor& k_weight, const at::Tensor& cos_sin_cache,
                                                  int64_t rotary_dim, double eps, double offset) {
  check_rotary(positions, q, k, cos_sin_cache, rotary_dim);
  const auto q_scale = norm_scale(q_weight, q.size(2), offset, "qk_norm_rotary");
  const auto k_scale = norm_scale(k_weight, k.size(2), offset, "qk_norm_rotary");
  return rotary_of(positions, q, k, cos_sin_cache, rotary_dim, q_scale.data(), k_scale.data(), float(eps));
}

// Gated DeltaNet's delta-rule inputs from its conv output `mixed_qkv` [T, >= 2 Hk Dk] and gate
// projections `a`, `b` [T, Hv] (rows may be strided, last dims contiguous), in one pass per
// token: q and k (the first two Hk Dk columns) L2-normalised per head in fp32 and rounded to the
// dtype, each key head repeated for the Hv / Hk value heads that share it, into [T, Hv, Dk];
// g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) rounded to the dtype, both as
// fp32 [T, Hv].
template <typename scalar_t>
void gated_delta_net_inputs_impl(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const float* decay,
                     const float* bias, int64_t hk, int64_t dk, int64_t hv, float eps, at::Tensor& q,
                     at::Tensor& k, at::Tensor& g, at::Tensor& beta) {
  const int64_t tokens = x.size(0), repeat = hv / hk, key_dim = hk * dk;
  const scalar_t* in = x.const_data_ptr<scalar_t>();
  const scalar_t* pa = a.const_data_ptr<scalar_t>();
  const scalar_t* pb = b.const_data_ptr<scalar_t>();
  scalar_t* outs[2] = {q.mutable_data_ptr<scalar_t>(), k.mutable_data_ptr<scalar_t>()};
  float* pg = g.mutable_data_ptr<float>();
  float* pbeta = beta.mutable_data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrainElements / (2 * hv * dk)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int which = 0; which < 2; ++which) {
        const scalar_t* row = in + t * x.stride(0) + which * key_dim;
        for (int64_t h = 0; h < hk; ++h) {
          const scalar_t* src = row + h * dk;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 0; i < dk; ++i) sum += to_float(src[i]) * to_float(src[i]);  // simd-checked
          const float inv = 1.f / std::sqrt(sum + eps);
          scalar_t* dst = outs[which] + (t * hv + h * repeat) * dk;
#pragma omp simd
          for (int64_t i = 0; i < dk; ++i) dst[i] = narrow<scalar_t>(to_float(src[i]) * inv);  // simd-checked
          for (int64_t r = 1; r < repeat; ++r) std::copy_n(dst, dk, dst + r * dk);
        }
      }
      for (int64_t h = 0; h < hv; ++h) {
        const float z = to_float(pa[t * a.stride(0) + h]) + bias[h];
        const float softplus = z > 20.f ? z : std::log1p(std::exp(z));  // torch's threshold
        pg[t * hv + h] = -decay[h] * softplus;
        const float sigmoid = 1.f / (1.f + std::exp(-to_float(pb[t * b.stride(0) + h])));
        pbeta[t * hv + h] = to_float(narrow<scalar_t>(sigmoid));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_net_inputs(
    const at::Tensor& mixed_qkv, const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
    const at::Tensor& dt_bias, int64_t num_k_heads, int64_t head_k_dim, int64_t num_v_heads, double eps) {
  const at::ScalarType dtype = mixed_qkv.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16,
                   "gated_delta_net_inputs: mixed_qkv must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(num_k_heads > 0 && head_k_dim > 0 && num_v_heads > 0 && num_v_heads % num_k_heads == 0,
                    "gated_delta_net_inputs: num_v_heads (", num_v_heads, ") must be a positive multiple of num_k_heads (",
                    num_k_heads, ") and head_k_dim (", head_k_dim, ") positive");
  const int64_t tokens = mixed_qkv.size(0);
  TORCH_CHECK_VALUE(mixed_qkv.device().is_cpu() && mixed_qkv.dim() == 2 && mixed_qkv.stride(1) == 1 &&
                        mixed_qkv.size(1) >= 2 * num_k_heads * head_k_dim,
                    "gated_delta_net_inputs: mixed_qkv must be a cpu tensor [tokens, >= ", 2 * num_k_heads * head_k_dim,
                    "] with a contiguous last dim, got ", mixed_qkv.sizes(), " strides ", mixed_qkv.strides());
  for (const auto& [x, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}}) {
    TORCH_CHECK_VALUE(x->device().is_cpu() && x->dim() == 2 && x->size(0) == tokens && x->size(1) == num_v_heads &&
                          (num_v_heads == 1 || x->stride(1) == 1),
                      "gated_delta_net_inputs: ", name, " must be a cpu tensor [", tokens, ", ", num_v_heads,
                      "] with a contiguous last dim, got ", x->sizes(), " strides ", x->strides());
    TORCH_CHECK_TYPE(x->scalar_type() == dtype, "gated_delta_net_inputs: ", name, " must be ", dtype, " as mixed_qkv, got ",
                     x->scalar_type());
  }
  for (const auto& [x, name] : {std::pair{&A_log, "A_log"}, std::pair{&dt_bias, "dt_bias"}})
    TORCH_CHECK_VALUE(x->dim() == 1 && x->size(0) == num_v_heads, "gated_delta_net_inputs: ", name, " must be [",
                      num_v_heads, "], got ", x->sizes());
  const at::Tensor A = A_log.to(at::kFloat).contiguous();
  const at::Tensor bias = dt_bias.to(at::kFloat).contiguous();
  std::vector<float> decay(num_v_heads);
  for (int64_t h = 0; h < num_v_heads; ++h) decay[h] = std::exp(A.const_data_ptr<float>()[h]);
  auto options = mixed_qkv.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor q = at::empty({tokens, num_v_heads, head_k_dim}, options);
  at::Tensor k = at::empty({tokens, num_v_heads, head_k_dim}, options);
  at::Tensor g = at::empty({tokens, num_v_heads}, options.dtype(at::kFloat));
  at::Tensor beta = at::empty({tokens, num_v_heads}, options.dtype(at::kFloat));
  if (tokens == 0) return {q, k, g, beta};
  const float* shift = bias.const_data_ptr<float>();
  if (dtype == at::kFloat)
    gated_delta_net_inputs_impl<float>(mixed_qkv, a, b, decay.data(), shift, num_k_heads, head_k_dim, num_v_heads, float(eps), q, k, g,
                           beta);
  else
    gated_delta_net_inputs_impl<c10::BFloat16>(mixed_qkv, a, b, decay.data(), shift, num_k_heads, head_k_dim, num_v_heads, float(eps),
                                   q, k, g, beta);
  return {q, k, g, beta};
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
    const float v = to_float(in[j]);  // simd-checked
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


// x as uint8 on the affine grid of (scale, zero_point): clamp(round_half_even(x * (1 / scale))
// + zero_point, 0, 255), the input of an int8 convolution, in one pass. `x` is any dense fp32
// or bf16 tensor; the result has its sizes and strides (a channels-last activation stays one).
template <typename scalar_t>
void quantize_u8_impl(const scalar_t* in, uint8_t* out, int64_t n, float inverse, float zero_point) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const __m512 inv = _mm512_set1_ps(inverse), zp = _mm512_set1_ps(zero_point);
    const __m512 lo = _mm512_setzero_ps(), hi = _mm512_set1_ps(255.0f);
    for (; i + 16 <= end; i += 16) {
      __m512 v;
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
        v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))), 16));
      else
        v = _mm512_loadu_ps(in + i);
      v = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, zp), lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(v)));
    }
#endif
    for (; i < end; ++i) {
      const float v = std::nearbyint(to_float(in[i]) * inverse) + zero_point;
      out[i] = uint8_t(std::min(std::max(v, 0.0f), 255.0f));
    }
  });
}

at::Tensor quantize_u8(const at::Tensor& x, double scale, int64_t zero_point) {
  TORCH_CHECK(x.device().is_cpu(), "quantize_u8: x must be on cpu, got ", x.device());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "quantize_u8: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_non_overlapping_and_dense(), "quantize_u8: x must be dense, got strides ", x.strides());
  TORCH_CHECK_VALUE(scale > 0 && 0 <= zero_point && zero_point <= 255,
                    "quantize_u8: need scale > 0 and zero_point in [0, 255], got ", scale, " and ", zero_point);
  at::Tensor out = at::empty_strided(x.sizes(), x.strides(), x.options().dtype(at::kByte));
  const float inverse = float(1.0 / scale);
  if (x.scalar_type() == at::kFloat)
    quantize_u8_impl(x.const_data_ptr<float>(), out.data_ptr<uint8_t>(), x.numel(), inverse, float(zero_point));
  else
    quantize_u8_impl(x.const_data_ptr<c10::BFloat16>(), out.data_ptr<uint8_t>(), x.numel(), inverse,
                     float(zero_point));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splittts_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float offset) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, int rotary_dim) -> (Tensor, Tensor)");
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("qk_norm_rotary(Tensor positions, Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
        "Tensor cos_sin_cache, int rotary_dim, float eps, float offset) -> (Tensor, Tensor)");
  m.def("gated_delta_net_inputs(Tensor mixed_qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, int num_k_heads, "
        "int head_k_dim, int num_v_heads, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("join_channels_last(Tensor first, Tensor then, float slope, int keep) -> (Tensor, Tensor)");
  m.def("add_joined_(Tensor(a!) t, Tensor first, Tensor then) -> Tensor");
  m.def("mean_joined(Tensor[] firsts, Tensor[] thens, int length) -> (Tensor, Tensor[])");
  m.def("quantize_u8(Tensor x, float scale, int zero_point) -> Tensor");
}

TORCH_LIBRARY_IMPL(splittts_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
  m.impl("gated_rms_norm", &gated_rms_norm);
  m.impl("write_kv", &write_kv);
  m.impl("qk_norm_rotary", &qk_norm_rotary);
  m.impl("gated_delta_net_inputs", &gated_delta_net_inputs);
  m.impl("join_channels_last", &join_channels_last);
  m.impl("add_joined_", &add_joined_);
  m.impl("mean_joined", &mean_joined);
  m.impl("quantize_u8", &quantize_u8);
}
