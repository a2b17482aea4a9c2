// Causal attention for a few new rows against the KV cache, computed row by row in a fixed order.
//
// Why: torch's batched matmuls pick different blockings (and so different summation orders) for
// different numbers of rows, so a token's attention output could differ in its last bits between a
// verification pass over K+1 rows and a plain one-row step. Here every (head, row) is computed by
// the same code whatever else is in the call: scores in fixed 8-lane order, softmax in sequence,
// the weighted sum of values key by key. Rows verified together equal rows decoded one at a time,
// bit for bit, and with integer-exact matrix products (int8) so do the logits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x
  const __m256 wv = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += w * x[i];
}

}  // namespace

// q [H, T, D] (scaled, rotated), keys/values [KV, >= start + T, D] with unit stride inside a position;
// row t sees positions 0 .. start + t. Returns [T, H * D].
torch::Tensor causal_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
              values.scalar_type() == torch::kFloat32, "fp32 only");
  auto qc = q.contiguous();
  const int64_t H = qc.size(0), T = qc.size(1), D = qc.size(2), KV = keys.size(0);
  TORCH_CHECK(H % KV == 0 && keys.size(1) >= start + T && keys.size(2) == D, "shapes");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1 && keys.stride(1) == D && values.stride(1) == D,
              "keys/values: unit stride within a position");
  const int64_t G = H / KV, ks = keys.stride(0), vs = values.stride(0);
  auto out = torch::zeros({T, H * D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, H * T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(start + T);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t h = idx / T, t = idx % T, g = h / G, n = start + t + 1;
      const float* qr = qp + (h * T + t) * D;
      const float* kh = kp + g * ks;
      const float* vh = vp + g * vs;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        weights[j] = dot(qr, kh + j * D, D);
        top = std::max(top, weights[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        weights[j] = std::exp(weights[j] - top);
        total += weights[j];
      }
      float* orow = op + t * H * D + h * D;
      for (int64_t j = 0; j < n; ++j) axpy(weights[j], vh + j * D, orow, D);
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
    }
  });
  return out;
}
