// Causal attention of a prompt (many rows at once) on AMX bf16 tiles, at about fp32's accuracy.
//
// Why: with the int8 products on tiles, torch's fp32 flash attention was a fifth of a 700-token prefill
// of Qwen2.5-Coder-1.5B (52 GFLOP/s, 20% of the vector units' peak). A tile multiply of bf16 values
// (tdpbf16ps: 16 x 16 x 32 products, fp32 sums) does 16 times the work of an AVX-512 FMA, but bf16 keeps
// 8 bits of a float's 24, and attention in plain bf16 cost 0.0065 nats a token of quality. So every fp32
// value x is split into two bf16 values, x = hi + lo + (a remainder below 2^-16 |x|), and a product is
// taken as hi*hi' + hi*lo' + lo*hi' (the "bf16x3" emulation of fp32: what is dropped, lo*lo' and the
// remainders, is about 2^-16 of each term): three tile multiplies in place of one fp32 product, each 16
// times cheaper.
//
// The three terms are one product over an inner dimension three times as long: queries as [hi | hi | lo]
// against keys as [hi | lo | hi] for the scores, probabilities as [hi | hi | lo] against values as
// [hi | lo | hi] (per block of 32 keys) for the output, so both are plain 2 x 2-tile products (as the int8
// GEMM's: 4 C tiles, 2 A, 2 B). Softmax in between is fp32 (exp16, the exact row maximum, fp32 sums);
// the output is divided by the fp32 sum at the end.
//
// This is for prompts only (more than INVARIANT_ROWS rows): a prompt is prefilled the same way whether a
// run is plain or speculative, so which kernel computes it changes no comparison between them. Few-row
// passes keep attention.cpp's row-by-row fp32 kernel, whose bits do not depend on the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "vec_math.h"

namespace {

// 16 floats -> their bf16 hi and lo parts (round to nearest even both times): x - hi is exact in fp32.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void split16(const float* x, uint16_t* hi, uint16_t* lo) {
  const __m512 v = _mm512_loadu_ps(x);
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), l);
}

// hi and lo parts of n floats (n a multiple of 16).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void split(const float* x, int64_t n, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < n; i += 16) split16(x + i, hi + i, lo + i);
}

// One 2 x 2 block of a tile product: C (32 rows x the 16 columns of each of B tiles b0, b1) = sum over ``steps``
// of A (16-row tiles at a0 and a0 + 16 rows, ``a_stride`` bytes a row, 64 bytes a step) x B (1 KB tiles,
// ``b_step`` bytes a step), stored as fp32 to c (``c_stride`` bytes a row: [32 rows][32 columns]).
__attribute__((target("amx-tile,amx-bf16"))) inline void bf16_block(const uint8_t* a0, int64_t a_stride, const uint8_t* b0,
                                                                     const uint8_t* b1, int64_t b_step, int64_t steps,
                                                                     float* c, int64_t c_stride) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint8_t* a1 = a0 + 16 * a_stride;
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a0 + s * 64, a_stride);
    _tile_loadd(6, b0 + s * b_step, 64);
    _tile_loadd(7, b1 + s * b_step, 64);
    _tile_loadd(5, a1 + s * 64, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  uint8_t* cb = reinterpret_cast<uint8_t*>(c);
  _tile_stored(0, cb, c_stride);
  _tile_stored(1, cb + 64, c_stride);
  _tile_stored(2, cb + 16 * c_stride, c_stride);
  _tile_stored(3, cb + 16 * c_stride + 64, c_stride);
}

struct Shapes {
  int64_t H, KV, T, D, start, n;  // n = start + T keys
  int64_t kblocks;                // 16-key blocks (n rounded up to 32, so that values pair up in 32s)
  int64_t dsteps;                 // 3D / 32: steps of the scores' product
};

// Keys of one KV head packed as B tiles of the scores' product: [16-key block][3D / 32 steps][16 rows:
// pairs of inner indices][16 keys][2], the inner dimension [hi | lo | hi] of each key.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void pack_keys(const float* k, int64_t k_stride, const Shapes& s,
                                                                      uint32_t* out) {
  std::vector<uint16_t> hi(s.D), lo(s.D);
  const int64_t words = s.D / 2;  // one 32-bit word = 2 bf16 of the inner dimension
  for (int64_t key = 0; key < s.kblocks * 16; ++key) {
    uint32_t* block = out + (key / 16) * s.dsteps * 256;
    if (key < s.n) {
      split(k + key * k_stride, s.D, hi.data(), lo.data());
    } else {
      std::fill(hi.begin(), hi.end(), uint16_t{0});
      std::fill(lo.begin(), lo.end(), uint16_t{0});
    }
    const uint16_t* parts[3] = {hi.data(), lo.data(), hi.data()};
    for (int64_t step = 0; step < s.dsteps; ++step) {
      const int64_t at = step * 16;  // first word of this step in the [3D / 2] words
      const uint16_t* part = parts[at / words];
      const int64_t w0 = at % words;
      for (int64_t r = 0; r < 16; ++r) {
        uint32_t word;
        std::memcpy(&word, part + 2 * (w0 + r), 4);
        block[step * 256 + r * 16 + key % 16] = word;
      }
    }
  }
}

// Values of one KV head packed as B tiles of the output's product: [32-key block][3 parts: hi, lo, hi]
// [D / 16 column tiles][16 rows: key pairs][16 columns][2 keys].
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void pack_values(const float* v, int64_t v_stride, const Shapes& s,
                                                                        uint16_t* out) {
  const int64_t ctiles = s.D / 16, pairs = s.kblocks / 2;
  std::vector<uint16_t> hi(2 * s.D), lo(2 * s.D);
  for (int64_t pair = 0; pair < pairs * 16; ++pair) {  // keys 2 pair and 2 pair + 1
    for (int e = 0; e < 2; ++e) {
      const int64_t key = 2 * pair + e;
      if (key < s.n) {
        split(v + key * v_stride, s.D, hi.data() + e * s.D, lo.data() + e * s.D);
      } else {
        std::fill(hi.begin() + e * s.D, hi.begin() + (e + 1) * s.D, uint16_t{0});
        std::fill(lo.begin() + e * s.D, lo.begin() + (e + 1) * s.D, uint16_t{0});
      }
    }
    const int64_t block = pair / 16, r = pair % 16;
    const uint16_t* parts[3] = {hi.data(), lo.data(), hi.data()};
    for (int part = 0; part < 3; ++part)
      for (int64_t ct = 0; ct < ctiles; ++ct) {
        uint16_t* tile = out + ((block * 3 + part) * ctiles + ct) * 512;
        for (int64_t d = 0; d < 16; ++d) {
          tile[r * 32 + d * 2] = parts[part][16 * ct + d];
          tile[r * 32 + d * 2 + 1] = parts[part][s.D + 16 * ct + d];
        }
      }
  }
}

// Rows r0 .. r0 + 31 of query head h (fewer at the end: the rest computed on zero queries and dropped).
__attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16"))) void attend_rows(
    const float* q, const uint32_t* keys, const uint16_t* values, const Shapes& s, int64_t h, int64_t r0, float* out) {
  const int64_t rows = std::min<int64_t>(32, s.T - r0), D = s.D, inner = 3 * D;
  // Keys these rows see: positions up to start + r0 + rows - 1; in 32-key blocks for the output's product.
  const int64_t seen = s.start + r0 + rows, blocks32 = (seen + 31) / 32, blocks16 = 2 * blocks32;
  const int64_t width = 32 * blocks32;
  thread_local std::vector<uint16_t> qx, px;
  thread_local std::vector<float> scores, o;
  qx.assign(32 * inner, 0);
  px.resize(32 * 3 * width);
  scores.resize(32 * width);
  o.resize(32 * D);
  // Queries as [hi | hi | lo] rows.
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* row = qx.data() + r * inner;
    split(q + (h * s.T + r0 + r) * D, D, row, row + 2 * D);
    std::memcpy(row + D, row, D * 2);
  }
  // Scores [32 rows][width keys]: 2 key blocks (32 keys) at a time.
  const uint8_t* qa = reinterpret_cast<const uint8_t*>(qx.data());
  const uint8_t* kb = reinterpret_cast<const uint8_t*>(keys);
  const int64_t key_block_bytes = s.dsteps * 1024;
  for (int64_t b = 0; b < blocks16; b += 2)
    bf16_block(qa, inner * 2, kb + b * key_block_bytes, kb + (b + 1) * key_block_bytes, 1024, s.dsteps,
                     scores.data() + b * 16, width * 4);
  // Softmax numerators e = exp(score - row max) over the keys a row sees (0 beyond), as [hi | hi | lo] per
  // 32 keys; sums in fp32.
  float sums[32];
  for (int64_t r = 0; r < 32; ++r) {
    float* row = scores.data() + r * width;
    const int64_t sees = r < rows ? s.start + r0 + r + 1 : 1;  // padding rows: one key, finite, dropped
    auto seen_lanes = [sees](int64_t j) -> __mmask16 {
      const int64_t left = sees - j;
      return left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
    };
    const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 tops = none;  // the maximum is the same in any order
    for (int64_t j = 0; j < sees; j += 16) tops = _mm512_max_ps(tops, _mm512_mask_loadu_ps(none, seen_lanes(j), row + j));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(tops));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 valid = seen_lanes(j);
      const __m512 e = valid == 0 ? _mm512_setzero_ps()  // keys past the row's position: no exp to take
                                  : _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift)));
      _mm512_storeu_ps(row + j, e);
      total = _mm512_add_ps(total, e);
    }
    sums[r] = _mm512_reduce_add_ps(total);
    uint16_t* prow = px.data() + r * 3 * width;
    for (int64_t blk = 0; blk < blocks32; ++blk) {
      uint16_t* at = prow + blk * 96;  // [hi (32) | hi (32) | lo (32)]
      for (int half = 0; half < 2; ++half) split16(row + blk * 32 + half * 16, at + half * 16, at + 64 + half * 16);
      std::memcpy(at + 32, at, 64);
    }
  }
  // Output [32 rows][D] = e x values, 2 column tiles at a time; steps: 3 per 32-key block.
  const uint8_t* pa = reinterpret_cast<const uint8_t*>(px.data());
  const uint8_t* vb = reinterpret_cast<const uint8_t*>(values);
  const int64_t ctiles = D / 16;
  for (int64_t ct = 0; ct < ctiles; ct += 2)
    bf16_block(pa, 3 * width * 2, vb + ct * 1024, vb + (ct + 1) * 1024, ctiles * 1024, 3 * blocks32,
                     o.data() + ct * 16, D * 4);
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + (r0 + r) * s.H * D + h * D;
    const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o.data() + r * D + d), inv));
  }
}

}  // namespace

// Whether prompts' attention runs here: AMX-BF16, a head size in 32s, and not turned off with
// VERISPEC_TILE_ATTENTION=0 (read on every call, so comparisons can switch it within a process).
bool prompt_attention_supported(int64_t head_dim) {
  const char* env = std::getenv("VERISPEC_TILE_ATTENTION");
  return has_amx_bf16() && head_dim % 32 == 0 && !(env != nullptr && std::strcmp(env, "0") == 0);
}

// q [H, T, D] fp32 (scaled, rotated), keys/values [KV, >= start + T, D] fp32 (rows contiguous); row t sees
// positions 0 .. start + t, query head h uses KV head h / (H / KV). Returns [T, H * D].
torch::Tensor prompt_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "q [H, T, D], keys/values [KV, S, D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
              values.scalar_type() == torch::kFloat32, "fp32 attention");
  auto qc = q.contiguous();
  Shapes s;
  s.H = qc.size(0); s.T = qc.size(1); s.D = qc.size(2); s.KV = keys.size(0); s.start = start; s.n = start + s.T;
  TORCH_CHECK(prompt_attention_supported(s.D), "prompt attention on tiles needs AMX-BF16 and a head size in 32s");
  TORCH_CHECK(keys.size(1) >= s.n && values.size(1) >= s.n && keys.size(2) == s.D && values.size(2) == s.D &&
              keys.stride(2) == 1 && values.stride(2) == 1 && s.H % s.KV == 0, "keys/values [KV, >= start + T, D]");
  s.kblocks = (s.n + 31) / 32 * 2;
  s.dsteps = 3 * s.D / 32;
  auto packed_keys = torch::empty({s.KV, s.kblocks * s.dsteps * 256}, q.options().dtype(torch::kInt32));
  auto packed_values = torch::empty({s.KV, s.kblocks / 2 * 3 * s.D * 32}, q.options().dtype(torch::kInt16));
  // Each KV head's packed keys and values, one contiguous row of these tensors each.
  uint32_t* kp = reinterpret_cast<uint32_t*>(packed_keys.data_ptr<int32_t>());
  uint16_t* vp = reinterpret_cast<uint16_t*>(packed_values.data_ptr<int16_t>());
  const int64_t k_per_head = packed_keys.size(1), v_per_head = packed_values.size(1);
  at::parallel_for(0, 2 * s.KV, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t g = i / 2;
      if (i % 2 == 0)
        pack_keys(keys.data_ptr<float>() + g * keys.stride(0), keys.stride(1), s, kp + g * k_per_head);
      else
        pack_values(values.data_ptr<float>() + g * values.stride(0), values.stride(1), s, vp + g * v_per_head);
    }
  });
  auto out = torch::empty({s.T, s.H * s.D}, q.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t groups = s.H / s.KV, row_blocks = (s.T + 31) / 32;
  // Latest rows first (they see the most keys), so the last items handed out are the cheap ones.
  dynamic_for(s.H * row_blocks, 1, amx_configure, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t rb = row_blocks - 1 - i / s.H, h = i % s.H, g = h / groups;
      attend_rows(qp, kp + g * k_per_head, vp + g * v_per_head, s, h, rb * 32, op);
    }
  }, amx_release);
  return out;
}
