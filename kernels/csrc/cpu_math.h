// Small vectorisable math shared by the CPU kernels.
//
// A source line marked `simd-checked` is where gcc reports a hot loop that must vectorise for
// AVX2 and for AVX-512; tests/test_kernels_vectorised.py checks gcc's report for both.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace splittts {

// e^x for x <= 0, without branches so that loops over it vectorise (libm's expf does not).
// x = n ln2 + r with |r| <= ln2/2; e^r by its Taylor series to degree 7 (relative error
// below 1e-8 on that range); 2^n built in the exponent bits. Inputs below -87 give e^-87.
inline float exp_nonpositive(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  x = std::max(x, -87.f);
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = x - n * 0.693145751953125f;  // ln2 split in two so that n * hi is exact
  r = r - n * 1.42860682030941723e-6f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * std::bit_cast<float>((int32_t(n) + 127) << 23);
}

// silu(x) = x * sigmoid(x), the sigmoid from e^-|x| so that the exponential never overflows.
inline float silu(float x) {
  const float t = exp_nonpositive(-std::fabs(x));
  const float sigmoid = (x >= 0.f ? 1.f : t) / (1.f + t);
  return x * sigmoid;
}

}  // namespace splittts
