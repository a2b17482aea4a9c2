// y[M, O] = x[M, I] @ w[O, I]^T for a draft's int4 weights: asymmetric, one (scale, low) pair per
// group of 32 inputs (w ~ scale * u + low, u in 0..15), with int8 activations (one fp32 scale per row,
// quantize_rows) and integer sums within each group.
//
// Why: a draft pass is a memory pass over its weights. int8 reads 1 byte per weight; these read 0.625
// (half a byte, plus two bf16 numbers per 32 weights), in one contiguous stream per 16 output channels
// (one stream per thread keeps the memory busy; several row streams at once ran ~1.3x slower on an
// AMD EPYC). torch's packed int4 kernel, with bf16 activations, was no faster than int8 for one row.
//
// Layout (kernels.PackedInt4Linear packs it): weights [O/16, I/8, 16, 4] bytes, byte (b, k, c, j) holding u of
// channel 16b + c at input 8k + j in its low nibble and at input 8k + 4 + j in its high nibble, so one
// 64-byte load holds 16 channels x 8 inputs; groups [O/16, I/32, 2, 16] bf16: the 16 channels' scales,
// then their lows. u is unsigned and the activations signed: exactly the operands of AVX-512 VNNI's
// vpdpbusd, and of AVX2's vpmaddubsw, whose 16-bit pair sums (at most 2 * 15 * 127) cannot saturate;
// a group's four steps then sum to at most 30,480, still within 16 bits.
//
// A draft's rows may depend on each other (the target verifies whatever it proposes), but these do not:
// each row is computed alone, in a fixed order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

std::vector<torch::Tensor> quantize_rows(torch::Tensor x);
bool cpu_has_avx512_vnni();  // int8_linear.cpp

namespace {

constexpr int64_t kGroup = 32;
constexpr int kRowTile = 4;

inline int32_t four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The quantized rows: a group adds scale * (its integer sum) + low * (the group's activation sum) to each
// channel's fp32 sum, and the row's scale multiplies the total.
struct Rows {
  const int8_t* q;     // [M, I]
  const int32_t* sum;  // [M, I / 32]: each group's activation sum
  int64_t in, groups;
};

// ------------------------------------------------------------------------------- AVX-512 VNNI

__attribute__((target("avx512f"))) inline __m512 widen_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void block_vnni(const uint8_t* w, const uint16_t* g,
                                                                          const Rows& x, int64_t m0, __m512* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t grp = 0; grp < x.groups; ++grp) {
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    for (int step = 0; step < kGroup / 8; ++step) {
      const int64_t k = grp * (kGroup / 8) + step;
      const __m512i v = _mm512_loadu_si512(w + k * 64);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = x.q + (m0 + r) * x.in + 8 * k;
        sums[r] = _mm512_dpbusd_epi32(sums[r], lo, _mm512_set1_epi32(four(a)));
        sums[r] = _mm512_dpbusd_epi32(sums[r], hi, _mm512_set1_epi32(four(a + 4)));
      }
    }
    const __m512 scale = widen_bf16(g + grp * 32), low = widen_bf16(g + grp * 32 + 16);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(static_cast<float>(x.sum[(m0 + r) * x.groups + grp])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) void channels_vnni(const uint8_t* w, const uint16_t* g,
                                                                             const Rows& x, int64_t rows,
                                                                             const float* xs, float* y,
                                                                             int64_t o, int64_t out) {
  const int64_t n = std::min<int64_t>(16, out - o);
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
  __m512 acc[kRowTile];
  for (int64_t m = 0; m < rows; m += kRowTile) {
    const int64_t tile = std::min<int64_t>(kRowTile, rows - m);
    switch (tile) {
      case 4: block_vnni<4>(w, g, x, m, acc); break;
      case 3: block_vnni<3>(w, g, x, m, acc); break;
      case 2: block_vnni<2>(w, g, x, m, acc); break;
      default: block_vnni<1>(w, g, x, m, acc); break;
    }
    for (int64_t r = 0; r < tile; ++r)
      _mm512_mask_storeu_ps(y + (m + r) * out + o, keep, _mm512_mul_ps(acc[r], _mm512_set1_ps(xs[m + r])));
  }
}

// --------------------------------------------------------------------------------------- AVX2

inline __m256 widen_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// Channels 8h..8h+7 of a block: the 32-byte half h of each 64-byte step.
template <int R>
void block_avx2(const uint8_t* w, const uint16_t* g, const Rows& x, int64_t m0, __m256* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t grp = 0; grp < x.groups; ++grp) {
    __m256i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    for (int step = 0; step < kGroup / 8; ++step) {
      const int64_t k = grp * (kGroup / 8) + step;
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 64 + 32 * h));
        lo[h] = _mm256_and_si256(v, nibble);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* a = x.q + (m0 + r) * x.in + 8 * k;
        const __m256i a0 = _mm256_set1_epi32(four(a)), a1 = _mm256_set1_epi32(four(a + 4));
        for (int h = 0; h < 2; ++h)  // 16-bit sums: at most 4 steps * 2 * (2 * 15 * 127) = 30,480
          sums[r][h] = _mm256_add_epi16(sums[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], a0),
                                                                     _mm256_maddubs_epi16(hi[h], a1)));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = widen_bf16x8(g + grp * 32 + 8 * h), low = widen_bf16x8(g + grp * 32 + 16 + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][h], ones));
        acc[r][h] = _mm256_fmadd_ps(s, scale, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(low, _mm256_set1_ps(static_cast<float>(x.sum[(m0 + r) * x.groups + grp])),
                                    acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    out[2 * r] = acc[r][0];
    out[2 * r + 1] = acc[r][1];
  }
}

void channels_avx2(const uint8_t* w, const uint16_t* g, const Rows& x, int64_t rows, const float* xs, float* y,
                   int64_t o, int64_t out) {
  const int64_t n = std::min<int64_t>(16, out - o);
  __m256 acc[2 * kRowTile];
  alignas(32) float lanes[16];
  for (int64_t m = 0; m < rows; m += kRowTile) {
    const int64_t tile = std::min<int64_t>(kRowTile, rows - m);
    switch (tile) {
      case 4: block_avx2<4>(w, g, x, m, acc); break;
      case 3: block_avx2<3>(w, g, x, m, acc); break;
      case 2: block_avx2<2>(w, g, x, m, acc); break;
      default: block_avx2<1>(w, g, x, m, acc); break;
    }
    for (int64_t r = 0; r < tile; ++r) {
      const __m256 s = _mm256_set1_ps(xs[m + r]);
      float* dst = y + (m + r) * out + o;
      if (n == 16) {
        _mm256_storeu_ps(dst, _mm256_mul_ps(acc[2 * r], s));
        _mm256_storeu_ps(dst + 8, _mm256_mul_ps(acc[2 * r + 1], s));
      } else {
        _mm256_store_ps(lanes, _mm256_mul_ps(acc[2 * r], s));
        _mm256_store_ps(lanes + 8, _mm256_mul_ps(acc[2 * r + 1], s));
        std::copy(lanes, lanes + n, dst);
      }
    }
  }
}

std::atomic<int> g_int4_vnni{0};  // the path every int4_linear call takes (kernels.int4_path sets it once)

}  // namespace

std::vector<std::string> int4_paths() {
  std::vector<std::string> paths;
  if (cpu_has_avx512_vnni()) paths.push_back("vnni");
  paths.push_back("avx2");
  return paths;
}

void set_int4_path(const std::string& path) {
  TORCH_CHECK(path == "avx2" || (path == "vnni" && cpu_has_avx512_vnni()), "int4 path: one of int4_paths(), got ", path);
  g_int4_vnni = path == "vnni" ? 1 : 0;
}

// ``w``: packed [O/16, I/8, 16, 4] uint8; ``groups``: [O/16, I/32, 2, 16] bf16 (scales, lows); O = 16 x blocks.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor groups, c10::optional<torch::Tensor> bias) {
  const int64_t in = x.size(-1);
  TORCH_CHECK(in % kGroup == 0, "int4: the input width must be a multiple of ", kGroup);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 4 && w.size(1) * 8 == in &&
                  w.size(2) == 16 && w.size(3) == 4,
              "int4 weights: packed [O/16, I/8, 16, 4] uint8");
  TORCH_CHECK(groups.scalar_type() == torch::kBFloat16 && groups.is_contiguous() && groups.dim() == 4 &&
                  groups.size(0) == w.size(0) && groups.size(1) * kGroup == in && groups.size(2) == 2 &&
                  groups.size(3) == 16,
              "int4 groups: [O/16, I/32, 2, 16] bf16");
  const int64_t out = w.size(0) * 16;
  auto quantized = quantize_rows(x);
  const auto& q = quantized[0];
  const int64_t rows = q.size(0), ngroups = in / kGroup;
  std::vector<int32_t> sums(rows * ngroups);  // each group's activation sum (a torch sum costs more here)
  const int8_t* qp = q.data_ptr<int8_t>();
  for (int64_t i = 0; i < rows * ngroups; ++i) {
    int32_t total = 0;
    for (int64_t j = 0; j < kGroup; ++j) total += qp[i * kGroup + j];
    sums[i] = total;
  }
  const Rows xr{qp, sums.data(), in, ngroups};
  const float* xs = quantized[1].data_ptr<float>();
  auto y = torch::empty({rows, out}, quantized[1].options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(groups.data_ptr<at::BFloat16>());
  const int64_t blocks = w.size(0), wstride = in / 8 * 64, gstride = ngroups * 32;
  const bool vnni = g_int4_vnni == 1;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (vnni) channels_vnni(wp + b * wstride, gp + b * gstride, xr, rows, xs, yp, 16 * b, out);
      else channels_avx2(wp + b * wstride, gp + b * gstride, xr, rows, xs, yp, 16 * b, out);
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(bias->to(torch::kFloat32));
  auto shape = x.sizes().vec();
  shape.back() = out;
  return y.view(shape);
}
