// Gated delta rule on CPU, as a recurrence over the tokens of packed sequences; one token per
// sequence (decode) is the same kernel with sequences of length 1. Each sequence's fp32 state
// [Hv, Dk, Dv] is read from and written back to its slot of the pool in place.
//
// Per value head and token: S = e^g S; delta = beta (v - S^T k); S += k (x) delta; o = scale S^T q.
// Written as e^g S^T k and e^g S^T q + (k.q) delta, the outputs need the old S only, so one pass
// over S per token applies token t's update and accumulates S^T k and S^T q for token t+1.
// Column j of S needs only column j of S and v[j]: a work item is one (sequence, head, block of
// 32 columns), whose Dk x 32 block of S (16 KiB for Dk 128) stays in L1 for all the sequence's
// tokens. On CPU this costs ~4 Dk Dv flops per token and head, no more than the chunked form's
// matrix products, and it needs no padding, masks or triangular solves.
//
// Layouts: q, k [T, Hv, Dk] and v [T, Hv, Dv] (float32 or bfloat16, rows may be strided, the
// last dim contiguous); g, beta [T, Hv] float32; ssm_state [slots, Hv, Dk, Dv] float32,
// contiguous; query_start_loc [B + 1] (none: one token per sequence) and state_indices [B] int64;
// has_initial_state [B] bool (none: every sequence continues from its state).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// The target's own vector width: 16 floats with AVX-512, 8 with AVX2. A generic vector wider
// than the registers is split into pairs of them, and then the sums of a block spill (on a Zen 3,
// 16-float vectors made the decode pass 3x and the prefill pass 5x slower than 8-float ones).
#if defined(__AVX512F__)
typedef float fvec __attribute__((vector_size(64)));
#else
typedef float fvec __attribute__((vector_size(32)));
#endif
constexpr int64_t kBlockColumns = 32;    // prefill: 16 KiB of S per item stays in L1
constexpr int64_t kDecodeColumns = 128;  // one token: whole rows, read in address order
constexpr int64_t kLanes = sizeof(fvec) / sizeof(float);
constexpr int64_t kMaxKeyDim = 1024;  // per-thread buffers of q and k rows widened to fp32

template <typename V>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// `[T, H, D]` rows of a tensor whose last dim is contiguous.
template <typename scalar_t>
struct Rows {
  const scalar_t* data;
  int64_t token_stride, head_stride;
  const scalar_t* at(int64_t t, int64_t h) const { return data + t * token_stride + h * head_stride; }
};

template <typename scalar_t>
Rows<scalar_t> rows_of(const at::Tensor& x) {
  return {x.const_data_ptr<scalar_t>(), x.stride(0), x.stride(1)};
}

// A row as fp32: the row itself, or widened into `buffer`.
inline const float* as_float(const float* row, float*, int64_t) { return row; }
inline const float* as_float(const c10::BFloat16* row, float* buffer, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = float(row[i]);
  return buffer;
}

template <typename scalar_t>
struct Problem {
  Rows<scalar_t> q, k, v;
  Rows<float> g, beta;
  scalar_t* out;  // contiguous [T, Hv, Dv]
  float* state;   // contiguous [slots, Hv, Dk, Dv]
  const int64_t* starts;
  const int64_t* slots;
  const bool* has_initial;  // null: every sequence continues from its state
  int64_t heads, dk, dv;
  float scale;
};

// Columns [j0, j0 + N * lanes(V)) of head h over tokens [t0, t1), the state block at `s` (row
// stride dv). V is a vector of floats or float itself (for the columns past the last full vector).
template <typename V, int N, typename scalar_t>
void run_block(const Problem<scalar_t>& p, int64_t h, int64_t t0, int64_t t1, float* s, int64_t j0,
               float* buffers) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  const int64_t dk = p.dk, dv = p.dv;
  float* kbuf[2] = {buffers, buffers + dk};
  float* qbuf[2] = {buffers + 2 * dk, buffers + 3 * dk};
  const float* k = as_float(p.k.at(t0, h), kbuf[0], dk);
  const float* q = as_float(p.q.at(t0, h), qbuf[0], dk);
  V a[N], b[N];  // S^T k and S^T q of the token about to be applied
  for (int n = 0; n < N; ++n) a[n] = b[n] = V{};
  for (int64_t i = 0; i < dk; ++i) {
    for (int n = 0; n < N; ++n) {
      const V row = load<V>(s + i * dv + n * lanes);
      a[n] += k[i] * row;
      b[n] += q[i] * row;
    }
  }
  for (int64_t t = t0; t < t1; ++t) {
    const float decay = std::exp(*p.g.at(t, h)), beta = *p.beta.at(t, h);
    float kq = 0.f;
#pragma omp simd reduction(+ : kq)
    for (int64_t i = 0; i < dk; ++i) kq += k[i] * q[i];
    const scalar_t* v = p.v.at(t, h) + j0;
    scalar_t* o = p.out + (t * p.heads + h) * dv + j0;
    V delta[N];
    for (int n = 0; n < N; ++n) {
      float vs[lanes], os[lanes];
      for (int64_t l = 0; l < lanes; ++l) vs[l] = float(v[n * lanes + l]);
      delta[n] = beta * (load<V>(vs) - decay * a[n]);
      store(os, p.scale * (decay * b[n] + kq * delta[n]));
      for (int64_t l = 0; l < lanes; ++l) o[n * lanes + l] = scalar_t(os[l]);
    }
    if (t + 1 < t1) {
      const float* k_next = as_float(p.k.at(t + 1, h), kbuf[(t + 1 - t0) & 1], dk);
      const float* q_next = as_float(p.q.at(t + 1, h), qbuf[(t + 1 - t0) & 1], dk);
      for (int n = 0; n < N; ++n) a[n] = b[n] = V{};
      for (int64_t i = 0; i < dk; ++i) {
        for (int n = 0; n < N; ++n) {
          float* cell = s + i * dv + n * lanes;
          const V row = decay * load<V>(cell) + k[i] * delta[n];
          store(cell, row);
          a[n] += k_next[i] * row;
          b[n] += q_next[i] * row;
        }
      }
      k = k_next;
      q = q_next;
    } else {
      for (int64_t i = 0; i < dk; ++i) {
        for (int n = 0; n < N; ++n) {
          float* cell = s + i * dv + n * lanes;
          store(cell, decay * load<V>(cell) + k[i] * delta[n]);
        }
      }
    }
  }
}

template <typename scalar_t>
void run(const Problem<scalar_t>& p, int64_t num_seqs, int64_t columns) {
  const int64_t blocks = (p.dv + columns - 1) / columns;
  const int64_t per_seq = p.heads * blocks;
  // item = (head, column block) major, sequence minor: each thread's range holds every
  // sequence for some heads, so unequal lengths still split evenly
  at::parallel_for(0, num_seqs * per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffers(4 * p.dk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item % num_seqs, hb = item / num_seqs;
      const int64_t h = hb / blocks, j0 = (hb % blocks) * columns;
      const int64_t t0 = p.starts[seq], t1 = p.starts[seq + 1];
      float* s = p.state + ((p.slots[seq] * p.heads + h) * p.dk) * p.dv + j0;
      const int64_t width = std::min(columns, p.dv - j0);
      if (p.has_initial != nullptr && !p.has_initial[seq])
        for (int64_t i = 0; i < p.dk; ++i) std::fill_n(s + i * p.dv, width, 0.f);
      if (t1 == t0) continue;
      int64_t j = 0;
      if (width == kDecodeColumns) {
        run_block<fvec, kDecodeColumns / kLanes>(p, h, t0, t1, s, j0, buffers.data());
        continue;
      }
      for (; j + kBlockColumns <= width; j += kBlockColumns)
        run_block<fvec, kBlockColumns / kLanes>(p, h, t0, t1, s + j, j0 + j, buffers.data());
      for (; j + kLanes <= width; j += kLanes) run_block<fvec, 1>(p, h, t0, t1, s + j, j0 + j, buffers.data());
      for (; j < width; ++j) run_block<float, 1>(p, h, t0, t1, s + j, j0 + j, buffers.data());
    }
  });
}

void check_rows(const at::Tensor& x, const char* name, int64_t tokens, int64_t heads, int64_t dim,
                at::ScalarType dtype) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 3 && x.size(0) == tokens && x.size(1) == heads &&
                        x.size(2) == dim && x.stride(2) == 1,
                    "gated_delta_rule: ", name, " must be a cpu tensor [", tokens, ", ", heads, ", ", dim,
                    "] with a contiguous last dim, got ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK_TYPE(x.scalar_type() == dtype, "gated_delta_rule: ", name, " must be ", dtype, ", got ",
                   x.scalar_type());
}

void check_gates(const at::Tensor& x, const char* name, int64_t tokens, int64_t heads) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.size(0) == tokens && x.size(1) == heads,
                    "gated_delta_rule: ", name, " must be a cpu tensor [", tokens, ", ", heads, "], got ",
                    x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "gated_delta_rule: ", name, " must be float32, got ",
                   x.scalar_type());
}

void check_index(const at::Tensor& x, const char* name, int64_t size, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 1 && x.size(0) == size && x.is_contiguous() &&
                        x.scalar_type() == dtype,
                    "gated_delta_rule: ", name, " must be a contiguous cpu ", dtype, " tensor [", size,
                    "], got ", x.sizes(), " ", x.scalar_type());
}

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta, const at::Tensor& ssm_state,
                            const std::optional<at::Tensor>& query_start_loc, const at::Tensor& state_indices,
                            const std::optional<at::Tensor>& has_initial_state, double scale) {
  TORCH_CHECK_VALUE(ssm_state.device().is_cpu() && ssm_state.dim() == 4 && ssm_state.is_contiguous() &&
                        ssm_state.scalar_type() == at::kFloat,
                    "gated_delta_rule: ssm_state must be a contiguous cpu float32 [slots, heads, dk, dv], got ",
                    ssm_state.sizes(), " ", ssm_state.scalar_type());
  const int64_t slots = ssm_state.size(0), heads = ssm_state.size(1), dk = ssm_state.size(2),
                dv = ssm_state.size(3), tokens = q.size(0), num_seqs = state_indices.numel();
  TORCH_CHECK_VALUE(dk <= kMaxKeyDim, "gated_delta_rule: key head dim ", dk, " is over ", kMaxKeyDim);
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16,
                   "gated_delta_rule: q, k and v must be float32 or bfloat16, got ", dtype);
  check_rows(q, "q", tokens, heads, dk, dtype);
  check_rows(k, "k", tokens, heads, dk, dtype);
  check_rows(v, "v", tokens, heads, dv, dtype);
  check_gates(g, "g", tokens, heads);
  check_gates(beta, "beta", tokens, heads);
  check_index(state_indices, "state_indices", num_seqs, at::kLong);
  if (has_initial_state) check_index(*has_initial_state, "has_initial_state", num_seqs, at::kBool);
  std::vector<int64_t> one_token_each;
  const int64_t* starts;
  if (query_start_loc) {
    check_index(*query_start_loc, "query_start_loc", num_seqs + 1, at::kLong);
    starts = query_start_loc->const_data_ptr<int64_t>();
  } else {
    one_token_each.resize(num_seqs + 1);
    for (int64_t b = 0; b <= num_seqs; ++b) one_token_each[b] = b;
    starts = one_token_each.data();
  }
  const int64_t* slot = state_indices.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(starts[0] == 0 && starts[num_seqs] == tokens,
                    "gated_delta_rule: query_start_loc must run from 0 to the ", tokens, " tokens, got ",
                    starts[0], " to ", starts[num_seqs]);
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK_VALUE(starts[b] <= starts[b + 1], "gated_delta_rule: query_start_loc must not decrease");
    TORCH_CHECK_VALUE(slot[b] >= 0 && slot[b] < slots, "gated_delta_rule: state_indices[", b, "] = ", slot[b],
                      " is outside the pool of ", slots, " slots");
  }
  at::Tensor out = at::empty({tokens, heads, dv}, v.options().memory_format(at::MemoryFormat::Contiguous));
  if (num_seqs == 0 || heads == 0 || dv == 0) return out;
  auto solve = [&](auto tag) {
    using scalar_t = decltype(tag);
    Problem<scalar_t> p{rows_of<scalar_t>(q), rows_of<scalar_t>(k), rows_of<scalar_t>(v),
                        {g.const_data_ptr<float>(), g.stride(0), g.stride(1)},
                        {beta.const_data_ptr<float>(), beta.stride(0), beta.stride(1)},
                        out.mutable_data_ptr<scalar_t>(), ssm_state.mutable_data_ptr<float>(), starts, slot,
                        has_initial_state ? has_initial_state->const_data_ptr<bool>() : nullptr,
                        heads, dk, dv, float(scale)};
    run(p, num_seqs, tokens == num_seqs ? kDecodeColumns : kBlockColumns);
  };
  if (dtype == at::kFloat)
    solve(float{});
  else
    solve(c10::BFloat16{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splittts_kernels, m) {
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) ssm_state, "
        "Tensor? query_start_loc, Tensor state_indices, Tensor? has_initial_state, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(splittts_kernels, CPU, m) { m.impl("gated_delta_rule", &gated_delta_rule); }
