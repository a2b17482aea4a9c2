// Causal attention for a few new rows against the KV cache, computed row by row in a fixed order.
//
// Why: torch's batched matmuls pick different blockings (and so different summation orders) for
// different numbers of rows, so a token's attention output could differ in its last bits between a
// verification pass over K+1 rows and a plain one-row step. Here every (head, row) is computed by
// the same code whatever else is in the call: scores in fixed 8-lane order, softmax in blocks of 8
// keys from the first, the weighted sum of values key by key. Rows verified together equal rows
// decoded one at a time, bit for bit, and with integer-exact matrix products (int8) so do the logits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

// Sum of 8 lanes in a fixed order: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline float lanes_sum(__m256 acc) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// Dot products of one query with B keys at once (independent accumulators, so the FMA latency of one
// chain overlaps the others); each product is the 8-lane sum over d in steps of 8, then lanes_sum,
// then the tail elements one by one: the same operations for a key whichever block it falls in.
template <int B>
inline void dots(const float* q, const float* k, int64_t D, float* out) {
  __m256 acc[B];
  for (int b = 0; b < B; ++b) acc[b] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int b = 0; b < B; ++b) acc[b] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + b * D + i), acc[b]);
  }
  for (int b = 0; b < B; ++b) {
    float s = lanes_sum(acc[b]);
    for (int64_t j = i; j < D; ++j) s += q[j] * k[b * D + j];
    out[b] = s;
  }
}

// Softmax numerators in place over w[0..n) (w holds room for n rounded up to 8): w[j] = e^(w[j] - max w);
// returns their sum, added in 8 lanes over blocks from the first key, then lanes_sum.
inline float exp_shifted(float* w, int64_t n) {
  const int64_t padded = (n + 7) / 8 * 8;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) top = std::max(top, w[i]);
  for (int64_t i = n; i < padded; ++i) w[i] = -std::numeric_limits<float>::infinity();  // e^-inf = 0
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < padded; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w + i), shift));
    _mm256_storeu_ps(w + i, e);
    total = _mm256_add_ps(total, e);
  }
  return lanes_sum(total);
}

// out[0..D) = sum over keys j in order of w[j] * v[j] (one FMA per element per key, in key order),
// 64 dimensions at a time held in registers; value rows ``stride`` floats apart.
inline void weighted_sum(const float* w, const float* v, int64_t n, int64_t D, float* out, int64_t stride) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 wv = _mm256_set1_ps(w[j]);
      const float* vj = v + j * stride + d0;
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vj + 8 * c), acc[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + d0 + 8 * c, acc[c]);
  }
  for (; d0 + 8 <= D; d0 += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v + j * stride + d0), acc);
    _mm256_storeu_ps(out + d0, acc);
  }
  for (; d0 < D; ++d0) {
    float acc = 0.f;
    for (int64_t j = 0; j < n; ++j) acc = std::fma(w[j], v[j * stride + d0], acc);
    out[d0] = acc;
  }
}

// weighted_sum for Q queries of one KV head at once, sharing each load of the values: 16 dimensions at a
// time, every element still one FMA per key in key order from zero, so each query's output has the bits
// weighted_sum gives it alone.
template <int Q>
inline void weighted_sums(const float* const* w, const float* v, int64_t n, int64_t D, float* const* out) {
  int64_t d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) {
    __m256 acc[Q][2];
    for (int a = 0; a < Q; ++a) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + j * D + d0;
      const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
      for (int a = 0; a < Q; ++a) {
        const __m256 wv = _mm256_set1_ps(w[a][j]);
        acc[a][0] = _mm256_fmadd_ps(wv, v0, acc[a][0]);
        acc[a][1] = _mm256_fmadd_ps(wv, v1, acc[a][1]);
      }
    }
    for (int a = 0; a < Q; ++a) {
      _mm256_storeu_ps(out[a] + d0, acc[a][0]);
      _mm256_storeu_ps(out[a] + d0 + 8, acc[a][1]);
    }
  }
  if (d0 < D)
    for (int a = 0; a < Q; ++a) weighted_sum(w[a], v + d0, n, D - d0, out[a] + d0, D);
}

}  // namespace

// q [H, T, D] (scaled, rotated), keys/values [KV, >= start + T, D] with unit stride inside a position;
// row t sees positions 0 .. start + t. Returns [T, H * D].
//
// A (head, row) pair's result depends only on its query, the keys and values it sees, and n = start + t + 1:
// keys are scored in blocks of 8 from the first one, so the blocking is the same whatever T is.
torch::Tensor causal_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
              values.scalar_type() == torch::kFloat32, "fp32 only");
  auto qc = q.contiguous();
  const int64_t H = qc.size(0), T = qc.size(1), D = qc.size(2), KV = keys.size(0);
  TORCH_CHECK(H % KV == 0 && keys.size(1) >= start + T && keys.size(2) == D, "shapes");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1 && keys.stride(1) == D && values.stride(1) == D,
              "keys/values: unit stride within a position");
  const int64_t G = H / KV, ks = keys.stride(0), vs = values.stride(0);
  auto out = torch::empty({T, H * D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // One work item: the G query heads that share a KV head, at one row. Keys are scored 8 at a time for
  // each head in turn while the block is in L1, and the values' loads are shared (weighted_sums): each
  // (head, row) still gets the operations, in the order, that it gets alone.
  at::parallel_for(0, KV * T, 1, [&](int64_t begin, int64_t end) {
    const int64_t wstride = start + T + 8;  // room for n rounded up to 8 (exp_shifted pads)
    std::vector<float> weights(G * wstride), inv(G);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t g = idx / T, t = idx % T, n = start + t + 1;
      const float* kh = kp + g * ks;
      const float* vh = vp + g * vs;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8)
        for (int64_t a = 0; a < G; ++a)
          dots<8>(qp + ((g * G + a) * T + t) * D, kh + j * D, D, weights.data() + a * wstride + j);
      for (; j < n; ++j)
        for (int64_t a = 0; a < G; ++a)
          dots<1>(qp + ((g * G + a) * T + t) * D, kh + j * D, D, weights.data() + a * wstride + j);
      for (int64_t a = 0; a < G; ++a) inv[a] = 1.f / exp_shifted(weights.data() + a * wstride, n);
      for (int64_t a0 = 0; a0 < G; a0 += 3) {
        const int q = static_cast<int>(std::min<int64_t>(3, G - a0));
        const float* w[3];
        float* rows[3];
        for (int a = 0; a < q; ++a) {
          w[a] = weights.data() + (a0 + a) * wstride;
          rows[a] = op + t * H * D + (g * G + a0 + a) * D;
        }
        if (q == 3) weighted_sums<3>(w, vh, n, D, rows);
        else if (q == 2) weighted_sums<2>(w, vh, n, D, rows);
        else weighted_sums<1>(w, vh, n, D, rows);
        for (int a = 0; a < q; ++a)
          for (int64_t d = 0; d < D; ++d) rows[a][d] *= inv[a0 + a];
      }
    }
  });
  return out;
}
