// y[M, O] = x[M, I] @ w[O, I]^T for bf16 weights and a few rows (M <= 16), on AVX2 + FMA CPUs.
//
// Why: on CPUs without native bf16 arithmetic, torch's bf16 matmul emulates per element and costs
// grow linearly with M, so verifying K drafted tokens costs about K single-token steps. Here each
// weight row is read from memory once, widened to fp32 in registers, and used for every input row:
// the cost stays close to one memory pass over the weights for M up to 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>

#include "vec_math.h"

namespace {

inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// One weight row against R input rows; in_features is a multiple of 8.
template <int R>
inline void row_block(const uint16_t* w, const float* x, int64_t in, int64_t m0, float* out, int64_t o,
                      int64_t out_stride) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in; i += 8) {
    __m256 wv = load_bf16x8(w + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m0 + r) * in + i), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[(m0 + r) * out_stride + o] = hsum(acc[r]);
}

}  // namespace

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2, "w: contiguous bf16 [O, I]");
  const int64_t out_features = w.size(0), in = w.size(1);
  TORCH_CHECK(in % 8 == 0, "in_features must be a multiple of 8");
  auto x2 = x.reshape({-1, in}).to(torch::kFloat32).contiguous();
  const int64_t rows = x2.size(0);
  auto y = torch::empty({rows, out_features}, x2.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint16_t* wr = wp + o * in;
      int64_t m = 0;
      for (; m + 8 <= rows; m += 8) row_block<8>(wr, xp, in, m, yp, o, out_features);
      // The remainder in one pass: each pass re-widens the weights, which costs as much as the FMAs.
      switch (rows - m) {
        case 7: row_block<7>(wr, xp, in, m, yp, o, out_features); break;
        case 6: row_block<6>(wr, xp, in, m, yp, o, out_features); break;
        case 5: row_block<5>(wr, xp, in, m, yp, o, out_features); break;
        case 4: row_block<4>(wr, xp, in, m, yp, o, out_features); break;
        case 3: row_block<3>(wr, xp, in, m, yp, o, out_features); break;
        case 2: row_block<2>(wr, xp, in, m, yp, o, out_features); break;
        case 1: row_block<1>(wr, xp, in, m, yp, o, out_features); break;
        default: break;
      }
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  return y.view(shape).to(x.scalar_type());
}

// RMSNorm over the last dimension of a contiguous fp32 tensor with an fp32 weight: one call instead of
// torch's five small kernels (each costs more in dispatch than in arithmetic at decode sizes).
// silu(gate) * up over one row of n elements: gate / (1 + e^-gate) * up, 16 lanes at a time on AVX-512
// CPUs (exp16), then 8 (exp8), the tail through a padded block: the same operations for every element,
// so its bits do not depend on where it falls or which width ran it.
__attribute__((target("avx512f"))) inline int64_t silu_mul_16(const float* gate, const float* up, float* out,
                                                               int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, silu_times16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  return i;
}

inline void silu_mul_8(const float* gate, const float* up, float* out) {
  const __m256 a = _mm256_loadu_ps(gate);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
  const __m256 s = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  _mm256_storeu_ps(out, _mm256_mul_ps(s, _mm256_loadu_ps(up)));
}

inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n, bool wide) {
  int64_t i = wide ? silu_mul_16(gate, up, out, n) : 0;
  for (; i + 8 <= n; i += 8) silu_mul_8(gate + i, up + i, out + i);
  if (i < n) {
    alignas(32) float a[8] = {}, b[8] = {}, c[8];
    std::copy(gate + i, gate + n, a);
    std::copy(up + i, up + n, b);
    silu_mul_8(a, b, c);
    std::copy(c, c + (n - i), out + i);
  }
}

// Sum of squares of a row in double: each float's square is exact in double, so the sum's only roundings
// are the additions, done in 16 partial sums (4 x 4 lanes, element i into partial i mod 16), combined in a
// fixed order, then the tail one by one. A row's bits depend on nothing but the row.
inline double sum_of_squares(const float* x, int64_t n) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int a = 0; a < 4; ++a) {
      const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * a));
      acc[a] = _mm256_add_pd(acc[a], _mm256_mul_pd(v, v));
    }
  const __m256d all = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, all);
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "fp32 only");
  auto xc = x.contiguous();
  const int64_t dim = xc.size(-1), rows = xc.numel() / dim;
  auto y = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows are independent (a prompt's rows split across threads; a row's bits never depend on them).
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * dim;
      const float scale = static_cast<float>(1.0 / std::sqrt(sum_of_squares(xr, dim) / dim + eps));
      for (int64_t i = 0; i < dim; ++i) yp[r * dim + i] = xr[i] * scale * wp[i];
    }
  });
  return y;
}

// silu(gate) * up for the fused [.., 2I] gate/up projection (gate first), fp32, row by row (silu_mul_row).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32, "fp32 only");
  auto g = gate_up.contiguous();
  const int64_t two = g.size(-1), half = two / 2, rows = g.numel() / two;
  auto shape = g.sizes().vec();
  shape.back() = half;
  auto y = torch::empty(shape, g.options());
  const float* gp = g.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool wide = __builtin_cpu_supports("avx512f");
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gp + r * two;
      silu_mul_row(gate, gate + half, yp + r * half, half, wide);
    }
  });
  return y;
}
