// Depthwise causal conv1d + SiLU over packed sequences on CPU, with each sequence's left
// context (its last K-1 inputs) read from and written back to its slot of the conv state pool
// in place. Decode is the same kernel with one token per sequence.
//
// y[t, c] = silu(sum_j w[c, j] x[t - (K-1) + j, c]), where inputs before a sequence's first
// token come from its state (or are zero when it has none). Arithmetic in fp32; y and the state
// keep the input dtype.
//
// Layouts: x [T, C] (float32 or bfloat16, rows may be strided, channels contiguous); weight
// [C, K]; conv_state [slots, C, K-1] of x's dtype, contiguous; query_start_loc [B + 1] (none:
// one token per sequence) and state_indices [B] int64; has_initial_state [B] bool (none: every
// sequence continues from its state).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_math.h"

namespace {

constexpr int64_t kGrainElements = 1 << 14;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return float(x); }

template <typename scalar_t>
struct Conv {
  const scalar_t* x;
  int64_t x_stride;
  const float* w;    // [K, C]: tap j of every channel contiguous
  scalar_t* state;   // [slots, C, K-1]
  scalar_t* out;     // [T, C]
  const int64_t* starts;
  const int64_t* seq_of_token;
  const int64_t* slots;
  const bool* has_initial;
  int64_t channels, taps;
};

template <typename scalar_t>
void conv_rows(const Conv<scalar_t>& p, int64_t begin, int64_t end) {
  const int64_t C = p.channels, width = p.taps - 1;
  std::vector<float> acc(C);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t seq = p.seq_of_token[t], local = t - p.starts[seq];
    const bool initial = p.has_initial == nullptr || p.has_initial[seq];
    const scalar_t* state = p.state + p.slots[seq] * C * width;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < p.taps; ++j) {
      const int64_t m = local - width + j;  // the input's position in its sequence
      const float* w = p.w + j * C;
      if (m >= 0) {
        const scalar_t* row = p.x + (p.starts[seq] + m) * p.x_stride;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) acc[c] += w[c] * to_float(row[c]);  // simd-checked
      } else if (initial) {
        const scalar_t* col = state + width + m;  // state[c, width + m]
        for (int64_t c = 0; c < C; ++c) acc[c] += w[c] * to_float(col[c * width]);  // simd-checked
      }
    }
    scalar_t* y = p.out + t * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) y[c] = scalar_t(splittts::silu(acc[c]));  // simd-checked
  }
}

// The state's K-1 columns become the last K-1 inputs of the sequence. Column j reads position
// len + j of the old [state | inputs] row, never one already overwritten, so it runs in place.
template <typename scalar_t>
void update_state(const Conv<scalar_t>& p, int64_t seq) {
  const int64_t C = p.channels, width = p.taps - 1;
  const int64_t start = p.starts[seq], len = p.starts[seq + 1] - start;
  const bool initial = p.has_initial == nullptr || p.has_initial[seq];
  scalar_t* state = p.state + p.slots[seq] * C * width;
  for (int64_t j = 0; j < width; ++j) {
    const int64_t m = len - width + j;
    if (m >= 0) {
      const scalar_t* row = p.x + (start + m) * p.x_stride;
      for (int64_t c = 0; c < C; ++c) state[c * width + j] = row[c];
    } else if (initial) {
      for (int64_t c = 0; c < C; ++c) state[c * width + j] = state[c * width + width + m];
    } else {
      for (int64_t c = 0; c < C; ++c) state[c * width + j] = scalar_t(0.f);
    }
  }
}

at::Tensor causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& conv_state,
                         const std::optional<at::Tensor>& query_start_loc, const at::Tensor& state_indices,
                         const std::optional<at::Tensor>& has_initial_state) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16,
                   "causal_conv1d: x must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1),
                    "causal_conv1d: x must be a cpu tensor [tokens, channels] with contiguous channels, got ",
                    x.sizes(), " strides ", x.strides());
  const int64_t tokens = x.size(0), C = x.size(1), num_seqs = state_indices.numel();
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) == C && weight.size(1) >= 1,
                    "causal_conv1d: weight must be [", C, ", kernel], got ", weight.sizes());
  const int64_t taps = weight.size(1), width = taps - 1;
  TORCH_CHECK_VALUE(conv_state.device().is_cpu() && conv_state.dim() == 3 && conv_state.size(1) == C &&
                        conv_state.size(2) == width && conv_state.is_contiguous() &&
                        conv_state.scalar_type() == dtype,
                    "causal_conv1d: conv_state must be a contiguous cpu ", dtype, " tensor [slots, ", C, ", ",
                    width, "], got ", conv_state.sizes(), " ", conv_state.scalar_type());
  auto check_index = [&](const at::Tensor& t, const char* name, int64_t size, at::ScalarType type) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == 1 && t.size(0) == size && t.is_contiguous() &&
                          t.scalar_type() == type,
                      "causal_conv1d: ", name, " must be a contiguous cpu ", type, " tensor [", size, "], got ",
                      t.sizes(), " ", t.scalar_type());
  };
  check_index(state_indices, "state_indices", num_seqs, at::kLong);
  if (has_initial_state) check_index(*has_initial_state, "has_initial_state", num_seqs, at::kBool);
  std::vector<int64_t> starts(num_seqs + 1);
  if (query_start_loc) {
    check_index(*query_start_loc, "query_start_loc", num_seqs + 1, at::kLong);
    std::copy_n(query_start_loc->const_data_ptr<int64_t>(), num_seqs + 1, starts.begin());
  } else {
    for (int64_t b = 0; b <= num_seqs; ++b) starts[b] = b;
  }
  TORCH_CHECK_VALUE(starts[0] == 0 && starts[num_seqs] == tokens, "causal_conv1d: query_start_loc must run "
                    "from 0 to the ", tokens, " tokens, got ", starts[0], " to ", starts[num_seqs]);
  const int64_t* slot = state_indices.const_data_ptr<int64_t>();
  std::vector<int64_t> seq_of_token(tokens);
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK_VALUE(starts[b] <= starts[b + 1], "causal_conv1d: query_start_loc must not decrease");
    TORCH_CHECK_VALUE(slot[b] >= 0 && slot[b] < conv_state.size(0), "causal_conv1d: state_indices[", b,
                      "] = ", slot[b], " is outside the pool of ", conv_state.size(0), " slots");
    std::fill(seq_of_token.begin() + starts[b], seq_of_token.begin() + starts[b + 1], b);
  }
  at::Tensor out = at::empty({tokens, C}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (C == 0 || num_seqs == 0) return out;

  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const float* w_rows = w.const_data_ptr<float>();
  std::vector<float> taps_first(taps * C);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < taps; ++j) taps_first[j * C + c] = w_rows[c * taps + j];

  auto solve = [&](auto tag) {
    using scalar_t = decltype(tag);
    const Conv<scalar_t> p{x.const_data_ptr<scalar_t>(), x.stride(0), taps_first.data(),
                           conv_state.mutable_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                           starts.data(), seq_of_token.data(), slot,
                           has_initial_state ? has_initial_state->const_data_ptr<bool>() : nullptr, C, taps};
    // every output first, while the states still hold the left context; then the new states
    at::parallel_for(0, tokens, std::max<int64_t>(1, kGrainElements / (C * taps)),
                     [&](int64_t begin, int64_t end) { conv_rows(p, begin, end); });
    if (width == 0) return;
    at::parallel_for(0, num_seqs, std::max<int64_t>(1, kGrainElements / (C * width)),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t b = begin; b < end; ++b) update_state(p, b);
                     });
  };
  if (dtype == at::kFloat)
    solve(float{});
  else
    solve(c10::BFloat16{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splittts_kernels, m) {
  m.def("causal_conv1d(Tensor x, Tensor weight, Tensor(a!) conv_state, Tensor? query_start_loc, "
        "Tensor state_indices, Tensor? has_initial_state) -> Tensor");
}

TORCH_LIBRARY_IMPL(splittts_kernels, CPU, m) { m.impl("causal_conv1d", &causal_conv1d); }
