// y[M, O] = x[M, I] @ w[O, I]^T with int8 weights (one fp32 scale per output channel) and int8
// activations (one fp32 scale per row, computed here), int32 accumulation, fp32 rescale.
//
// Why integers: an int32 sum is the same whatever order it is added in, so a row's result does not
// depend on how many other rows share the call or which code path ran it. Rows verified together
// equal rows decoded one at a time, bit for bit — which is what makes greedy speculative output
// identical to plain greedy output — and every path below (AVX-512 VNNI, AVX2, torch's _int_mm for
// many rows) gives the same bits, so the fastest can be chosen by measurement on the machine.
//
// The few-row paths read each weight row once for up to 4 input rows at a time (the weights of a
// block of 4 output channels then stay in L1 for the next rows), so M = 16 costs little more than
// one memory pass over the weights.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <array>
#include <atomic>
#include <limits>
#include <utility>

#include "amx.h"
#include "vec_math.h"

namespace {

constexpr int64_t kBlock = 4;  // output channels per block (weights read once per block)

// ------------------------------------------------------------------------------------------ quantize

// Symmetric per-row quantization: scale = max|x| / 127, q = round-half-even(x * 127 / max|x|).
// A row holding NaN or infinity gets a NaN scale, so the product's row is NaN (never garbage).
// One row of ``in`` values, 8 lanes at a time (AVX2).
void quantize_row_avx2(const float* xr, int64_t in, int8_t* qr, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.f), most = _mm256_set1_ps(std::numeric_limits<float>::max());
  // max |x| (the same whatever the order) and whether every element is finite (|x| <= FLT_MAX, false for NaN)
  __m256 top = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + i));
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, most, _CMP_LE_OQ));
    top = _mm256_max_ps(top, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  bool finite = _mm256_movemask_ps(ok) == 0xff;
  for (; i < in; ++i) {
    finite &= std::isfinite(xr[i]);
    amax = std::max(amax, std::fabs(xr[i]));
  }
  if (!finite || amax == 0.f) {
    std::fill(qr, qr + in, int8_t{0});
    *scale = finite ? 1.f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float inv = 127.f / amax;
  *scale = amax / 127.f;
  // q = round-half-even(x * inv) clamped to [-127, 127]: vroundps in the default rounding mode is nearbyint
  const __m256 iv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  auto ints = [&](int64_t at) {
    __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + at), iv), _MM_FROUND_CUR_DIRECTION);
    return _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
  };
  // 32 at a time narrowed to bytes by two packs (in range already, so nothing saturates); the packs
  // work within 128-bit lanes, and the permutation puts the four groups of 4 back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (i = 0; i + 32 <= in; i += 32) {
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(ints(i), ints(i + 8)),
                                             _mm256_packs_epi32(ints(i + 16), ints(i + 24)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + i), _mm256_permutevar8x32_epi32(words, order));
  }
  alignas(32) int32_t lanes8[8];
  for (; i + 8 <= in; i += 8) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes8), ints(i));
    for (int l = 0; l < 8; ++l) qr[i + l] = static_cast<int8_t>(lanes8[l]);
  }
  for (; i < in; ++i) {
    const float v = std::nearbyint(xr[i] * inv);
    qr[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
}

// round(x * inv) in the current rounding mode (nearest even), clamped to [-127, 127], as int32 lanes.
__attribute__((target("avx512f"))) inline __m512i rounded16(__m512 x, __m512 inv) {
  const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(x, inv), _MM_FROUND_CUR_DIRECTION);
  return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_set1_ps(127.f), _mm512_max_ps(_mm512_set1_ps(-127.f), v)));
}

// The same on 16 lanes (AVX-512): the same operations (maximum, the reciprocal, multiply, round in the
// current mode, clamp), so the same bytes and scale as quantize_row_avx2.
__attribute__((target("avx512f,avx512bw"))) void quantize_row_avx512(const float* xr, int64_t in, int8_t* qr, float* scale) {
  const __m512 most = _mm512_set1_ps(std::numeric_limits<float>::max());
  __m512 top = _mm512_setzero_ps();
  __mmask16 bad = 0;  // lanes that held NaN or infinity (not |x| <= FLT_MAX)
  const int64_t full = in / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (in - full)) - 1);
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xr + i));
    bad |= _mm512_cmp_ps_mask(a, most, _CMP_NLE_UQ);
    top = _mm512_max_ps(top, a);
  }
  if (tail) {
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, xr + full));
    bad |= _mm512_mask_cmp_ps_mask(tail, a, most, _CMP_NLE_UQ);
    top = _mm512_max_ps(top, a);
  }
  const float amax = _mm512_reduce_max_ps(top);
  if (bad != 0 || amax == 0.f) {
    std::fill(qr, qr + in, int8_t{0});
    *scale = bad == 0 ? 1.f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float inv = 127.f / amax;
  *scale = amax / 127.f;
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < full; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm512_cvtsepi32_epi8(rounded16(_mm512_loadu_ps(xr + i), iv)));
  if (tail) _mm512_mask_cvtsepi32_storeu_epi8(qr + full, tail, rounded16(_mm512_maskz_loadu_ps(tail, xr + full), iv));
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes;
}

// Rows in parallel, 16 lanes where the CPU has AVX-512 (unless ``lanes`` is 8: the tests compare both).
void quantize_rows_impl(const float* x, int64_t rows, int64_t in, int8_t* q, float* scale, int lanes) {
  const bool wide = lanes == 16 && has_avx512();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (wide) quantize_row_avx512(x + r * in, in, q + r * in, scale + r);
      else quantize_row_avx2(x + r * in, in, q + r * in, scale + r);
    }
  });
}

// ------------------------------------------------------------------- AVX-512 VNNI path, weights as rows

// vpdpbusd multiplies unsigned by signed bytes: the activations go in as q + 128, and 128 * sum(w)
// (precomputed per channel) is subtracted at the end. Tails use masked loads (zeros add nothing).
template <int NR, int NO>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile_vnni(
    const uint8_t* xu, const int8_t* w, const int32_t* wsum, int64_t in, int64_t r0, int64_t o,
    int32_t* acc, int64_t out) {
  __m512i a[NR][NO];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NO; ++j) a[r][j] = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 <= in; i += 64) {
    __m512i wv[NO];
    for (int j = 0; j < NO; ++j) wv[j] = _mm512_loadu_si512(w + (o + j) * in + i);
    for (int r = 0; r < NR; ++r) {
      const __m512i xv = _mm512_loadu_si512(xu + (r0 + r) * in + i);
      for (int j = 0; j < NO; ++j) a[r][j] = _mm512_dpbusd_epi32(a[r][j], xv, wv[j]);
    }
  }
  if (i < in) {
    const __mmask64 m = ~0ULL >> (64 - (in - i));
    __m512i wv[NO];
    for (int j = 0; j < NO; ++j) wv[j] = _mm512_maskz_loadu_epi8(m, w + (o + j) * in + i);
    for (int r = 0; r < NR; ++r) {
      const __m512i xv = _mm512_maskz_loadu_epi8(m, xu + (r0 + r) * in + i);
      for (int j = 0; j < NO; ++j) a[r][j] = _mm512_dpbusd_epi32(a[r][j], xv, wv[j]);
    }
  }
  if constexpr (NO == 4) {
    // Four channels' sums at once: interleave and add (integers: the order changes nothing).
    const __m128i bias = _mm_mullo_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wsum + o)), _mm_set1_epi32(128));
    for (int r = 0; r < NR; ++r) {
      const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[r][0], a[r][1]), _mm512_unpackhi_epi32(a[r][0], a[r][1]));
      const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[r][2], a[r][3]), _mm512_unpackhi_epi32(a[r][2], a[r][3]));
      const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
      const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
      const __m128i q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(acc + (r0 + r) * out + o), _mm_sub_epi32(q, bias));
    }
  } else {
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NO; ++j) acc[(r0 + r) * out + o + j] = _mm512_reduce_add_epi32(a[r][j]) - 128 * wsum[o + j];
  }
}

template <int NO>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void block_vnni(
    const uint8_t* xu, const int8_t* w, const int32_t* wsum, int64_t rows, int64_t in, int64_t o, int32_t* acc,
    int64_t out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile_vnni<4, NO>(xu, w, wsum, in, r, o, acc, out);
  switch (rows - r) {
    case 3: tile_vnni<3, NO>(xu, w, wsum, in, r, o, acc, out); break;
    case 2: tile_vnni<2, NO>(xu, w, wsum, in, r, o, acc, out); break;
    case 1: tile_vnni<1, NO>(xu, w, wsum, in, r, o, acc, out); break;
    default: break;
  }
}

// ------------------------------------------------------------------------- AVX-512 VNNI, packed weights

// Weights packed as [O/16][I/4][16][4] (``pack_vnni`` in kernels/__init__.py): one 64-byte load holds
// 4 consecutive inputs of 16 output channels, and each activation row contributes its 4 bytes by a
// broadcast. R rows (R <= 16) keep one accumulator of 16 channels each, so the weights are read once
// for all of them and no horizontal sums are needed. Short row counts split the inputs over several
// accumulator sets, so dependent vpdpbusd chains do not stall.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void packed_tile(
    const uint8_t* xu, int64_t i4, int64_t r0, const int8_t* wb, int64_t kbs, const int32_t* wsum16,
    int32_t* acc, int64_t out, int64_t o0, __mmask16 valid) {
  constexpr int S = R <= 4 ? 4 : R <= 8 ? 2 : 1;
  __m512i a[S][R];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) a[s][r] = _mm512_setzero_si512();
  const uint8_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = xu + (r0 + r) * i4;
  auto word = [](const uint8_t* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
  };
  int64_t kb = 0;
  for (; kb + S <= kbs; kb += S)
    for (int s = 0; s < S; ++s) {
      const __m512i wv = _mm512_loadu_si512(wb + (kb + s) * 64);
      for (int r = 0; r < R; ++r)
        a[s][r] = _mm512_dpbusd_epi32(a[s][r], _mm512_set1_epi32(word(xr[r] + (kb + s) * 4)), wv);
    }
  for (; kb < kbs; ++kb) {
    const __m512i wv = _mm512_loadu_si512(wb + kb * 64);
    for (int r = 0; r < R; ++r) a[0][r] = _mm512_dpbusd_epi32(a[0][r], _mm512_set1_epi32(word(xr[r] + kb * 4)), wv);
  }
  const __m512i bias = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(valid, wsum16), _mm512_set1_epi32(128));
  for (int r = 0; r < R; ++r) {
    __m512i total = a[0][r];
    for (int s = 1; s < S; ++s) total = _mm512_add_epi32(total, a[s][r]);
    _mm512_mask_storeu_epi32(acc + (r0 + r) * out + o0, valid, _mm512_sub_epi32(total, bias));
  }
}

using PackedTile = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, const int32_t*, int32_t*,
                            int64_t, int64_t, __mmask16);

template <int... Rs>
constexpr std::array<PackedTile, sizeof...(Rs)> packed_tiles(std::integer_sequence<int, Rs...>) {
  return {&packed_tile<Rs + 1>...};
}

// --------------------------------------------------------------------------------------- AMX path

// Intel AMX (Sapphire Rapids and later): a tile multiply does 16 rows x 16 channels x 64 inputs at
// once, so 16 rows cost about what one does and verification is bound by reading the weights, not by
// arithmetic. The packed layout above is exactly the B-tile layout when the inputs are padded to a
// multiple of 64: 16 steps of [16 channels][4 inputs] = one 1 KB tile. Activations (q + 128) form the
// A tile, 16 rows (padded with zero activations) x 64 bytes; 4 channel blocks share each A tile.


// What the AMX path's epilogue needs to write int8_linear's fp32 result directly.
struct Rescale {
  const float* x_scale;  // [rows]
  const float* w_scale;  // [out]
  const float* bias;     // [out] or null
  float* y;              // [rows, out], or [rows, half] with silu
  int64_t half = 0;      // > 0: y = silu(gate) * up of a [gate | up] product, gate's width half (see amx_silu)
};

// One row of a stored C tile as int8_linear's loop computes it, lane by lane: (float(sums - 128 * sum(w))
// * x_scale) * w_scale, with ``shift`` = 128 * sum(w) for the tile's 16 channels.
__attribute__((target("avx512f"))) inline __m512 rescaled(const int32_t* c_row, __m512i shift, float x_scale,
                                                          __m512 w_scale) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c_row), shift));
  return _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(x_scale)), w_scale);
}

// Subtract 128 * sum(w) from a stored C tile c [16 rows][16 channels] (the activations went in as q + 128)
// and write rows row0 + first .. row0 + end - 1 (those below ``rows``) of channels o0 .. o0 + 15: int32 sums to acc,
// or, given a rescale, (float(acc) * x_scale) * w_scale (+ bias) in fp32 to rescale->y — int8_linear's
// loop, lane by lane, while the sums are in registers (no int32 matrix written and read back).
__attribute__((target("avx512f,avx512bw"))) inline void amx_epilogue(
    const int32_t* c, int64_t row0, int64_t o0, const int32_t* wsum, int32_t* acc, int64_t rows, int64_t out,
    const Rescale* rescale, int64_t first = 0, int64_t end = 16) {
  const int64_t n = std::min<int64_t>(16, out - o0), last = std::min<int64_t>(end, rows - row0);
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  const __m512i bias = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(valid, wsum + o0), _mm512_set1_epi32(128));
  if (rescale == nullptr) {
    for (int64_t r = first; r < last; ++r)
      _mm512_mask_storeu_epi32(acc + (row0 + r) * out + o0, valid, _mm512_sub_epi32(_mm512_load_si512(c + r * 16), bias));
    return;
  }
  const __m512 ws = _mm512_maskz_loadu_ps(valid, rescale->w_scale + o0);
  const __m512 wb = rescale->bias ? _mm512_maskz_loadu_ps(valid, rescale->bias + o0) : _mm512_setzero_ps();
  for (int64_t r = first; r < last; ++r) {
    const int64_t row = row0 + r;
    __m512 v = rescaled(c + r * 16, bias, rescale->x_scale[row], ws);
    if (rescale->bias) v = _mm512_add_ps(v, wb);
    _mm512_mask_storeu_ps(rescale->y + row * out + o0, valid, v);
  }
}

// silu(gate) * up from a gate tile c and the matching up tile d (channels o0 and o0 + up_offset of a
// [gate | up] product; rows row0 + first .. row0 + end - 1 below ``rows``): each value rescaled as amx_epilogue does,
// then silu_mul's operations (silu_times16) lane by lane, so the bits are those of int8_linear followed
// by silu_mul, without the [rows, 2 * half] product written and read back.
__attribute__((target("avx512f,avx512bw"))) inline void amx_silu(
    const int32_t* c, const int32_t* d, int64_t row0, int64_t o0, int64_t up_offset, const int32_t* wsum,
    int64_t rows, const Rescale& rescale, int64_t first = 0, int64_t end = 16) {
  const int64_t last = std::min<int64_t>(end, rows - row0);
  const __m512i k128 = _mm512_set1_epi32(128);
  const __m512i bias_g = _mm512_mullo_epi32(_mm512_loadu_si512(wsum + o0), k128);
  const __m512i bias_u = _mm512_mullo_epi32(_mm512_loadu_si512(wsum + o0 + up_offset), k128);
  const __m512 ws_g = _mm512_loadu_ps(rescale.w_scale + o0), ws_u = _mm512_loadu_ps(rescale.w_scale + o0 + up_offset);
  for (int64_t r = first; r < last; ++r) {
    const int64_t row = row0 + r;
    const float xs = rescale.x_scale[row];
    _mm512_storeu_ps(rescale.y + row * rescale.half + o0,
                     silu_times16(rescaled(c + r * 16, bias_g, xs, ws_g), rescaled(d + r * 16, bias_u, xs, ws_u)));
  }
}

// Few rows (a decode step, a verification pass): one row tile against NB (1 or 4) channel blocks, all
// row tiles in turn; the weights stream from memory once for every row.
template <int NB>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) void amx_group(
    const uint8_t* xu, int64_t i64, int64_t row_tiles, const int8_t* wp, int64_t block0, int64_t kbs,
    const int32_t* wsum, int32_t* acc, int64_t rows, int64_t out, const Rescale* rescale) {
  alignas(64) int32_t c[16 * 16];
  const int64_t steps = kbs / 16;
  for (int64_t rt = 0; rt < row_tiles; ++rt) {
    const uint8_t* xa = xu + rt * 16 * i64;
    _tile_zero(0);
    if (NB > 1) { _tile_zero(1); _tile_zero(2); _tile_zero(3); }
    for (int64_t k = 0; k < steps; ++k) {
      _tile_loadd(4, xa + k * 1024, 64);
      _tile_loadd(5, wp + ((block0 + 0) * kbs + k * 16) * 64, 64);
      _tile_dpbusd(0, 4, 5);
      if (NB > 1) {
        _tile_loadd(6, wp + ((block0 + 1) * kbs + k * 16) * 64, 64);
        _tile_dpbusd(1, 4, 6);
        _tile_loadd(5, wp + ((block0 + 2) * kbs + k * 16) * 64, 64);
        _tile_dpbusd(2, 4, 5);
        _tile_loadd(6, wp + ((block0 + 3) * kbs + k * 16) * 64, 64);
        _tile_dpbusd(3, 4, 6);
      }
    }
    for (int nb = 0; nb < NB; ++nb) {
      switch (nb) {
        case 0: _tile_stored(0, c, 64); break;
        case 1: _tile_stored(1, c, 64); break;
        case 2: _tile_stored(2, c, 64); break;
        default: _tile_stored(3, c, 64); break;
      }
      amx_epilogue(c, rt * 16, (block0 + nb) * 16, wsum, acc, rows, out, rescale);
    }
  }
}

// What every 2 x 2 block's epilogue writes to: the sums' destination and their rescale.
struct Epilogue {
  const int32_t* wsum;
  int32_t* acc;
  int64_t rows, out;
  const Rescale* rescale;
};

// A block's stored C tiles whose epilogue has not run yet: it runs a few rows at a time inside the next
// block's loop, on the vector units while the tile unit multiplies (run after the tile stores, it left
// the tile unit idle; the 1.5B's prompt products measured 1.03-1.10x with this, the tiled activations
// and the loop order together, taking turns with the earlier kernel in one process).
struct Pending {
  alignas(64) int32_t c[4][16 * 16];  // tiles (row tile, block): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1)
  int64_t rt0 = 0, block0 = 0, second = 0;
  int rt = 0, nb = 0;  // the block's row tiles and channel blocks; rt == 0: nothing pending
  int64_t done = 0;    // its rows (of 16 * rt) written so far
};

// Rows done .. until - 1 of the pending block.
__attribute__((target("avx512f,avx512bw"))) inline void run_pending(Pending& p, int64_t until, const Epilogue& e) {
  until = std::min<int64_t>(until, 16 * p.rt);
  const bool silu = e.rescale != nullptr && e.rescale->half > 0;
  while (p.done < until) {
    const int64_t t = p.done / 16, first = p.done % 16, end = std::min<int64_t>(16, first + until - p.done);
    const int64_t row0 = (p.rt0 + t) * 16;
    if (silu) {  // (the caller pairs every gate block with its up block: nb == 2)
      amx_silu(p.c[2 * t], p.c[2 * t + 1], row0, p.block0 * 16, p.second * 16, e.wsum, e.rows, *e.rescale, first, end);
    } else {
      amx_epilogue(p.c[2 * t], row0, p.block0 * 16, e.wsum, e.acc, e.rows, e.out, e.rescale, first, end);
      if (p.nb > 1)
        amx_epilogue(p.c[2 * t + 1], row0, (p.block0 + p.second) * 16, e.wsum, e.acc, e.rows, e.out, e.rescale, first, end);
    }
    p.done += end - first;
  }
  if (p.done == 16 * p.rt) p.rt = 0;
}

// Many rows (a prompt): RT (1 or 2) row tiles against NB (1 or 2) channel blocks, tiles C 0-3 = (row
// tile, block) pairs, A 4-5, B 6-7. Each step loads 4 tiles for 4 multiplies where amx_group loads 5:
// products are bound by tile loads, not multiplies (on a Xeon with a 2 MB L2, 2 x 2 ran 700 GMAC/s per
// core with the weights in L2, 1 x 4 480).
//
// The second channel block is block0 + second (the next one; or, for silu(gate) * up, the up block that
// matches the gate block). ``next`` holds the starts of a later pair's two blocks (kbs lines each), whose
// lines first_line .. are prefetched into L2, lines_per_step per step, while this pair computes: tile
// loads from memory wait on each cache miss (the hardware prefetcher does not cover them). The previous
// block's epilogue (``pending``) runs inside the loop; this block's C tiles are left in ``pending``.
template <int RT, int NB>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) void amx_block(
    const uint8_t* xu, int64_t i64, int64_t rt0, const int8_t* wp, int64_t block0, int64_t second, int64_t kbs,
    const Epilogue& epilogue, Pending& pending, const std::array<const int8_t*, 2>& next, int64_t first_line,
    int64_t lines_per_step) {
  const uint8_t* xa = xu + rt0 * 16 * i64;
  const int8_t* wa = wp + block0 * kbs * 64;
  const int8_t* wb = wp + (block0 + second) * kbs * 64;
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (RT > 1) _tile_zero(2);
  if (RT > 1 && NB > 1) _tile_zero(3);
  // Line l of the next pair is line l of its first block, or line l - kbs of its second (no division in
  // the loop: an integer divide per line cost more than the tile multiplies of a step).
  const int8_t* next_line[2] = {next[0], next[1] ? next[1] - kbs * 64 : nullptr};
  const int64_t steps = kbs / 16, owed = 16 * pending.rt;
  for (int64_t k = 0; k < steps; ++k) {
    for (int64_t l = first_line + k * lines_per_step, e = std::min(l + lines_per_step, 2 * kbs); l < e; ++l) {
      const int second_block = l >= kbs;
      if (next_line[second_block]) _mm_prefetch(reinterpret_cast<const char*>(next_line[second_block] + l * 64), _MM_HINT_T1);
    }
    _tile_loadd(4, xa + k * 1024, 64);
    _tile_loadd(6, wa + k * 1024, 64);
    if (NB > 1) _tile_loadd(7, wb + k * 1024, 64);
    if (RT > 1) _tile_loadd(5, xa + 16 * i64 + k * 1024, 64);
    _tile_dpbusd(0, 4, 6);
    if (NB > 1) _tile_dpbusd(1, 4, 7);
    if (RT > 1) _tile_dpbusd(2, 5, 6);
    if (RT > 1 && NB > 1) _tile_dpbusd(3, 5, 7);
    if (pending.rt) run_pending(pending, (k + 1) * owed / steps + 1, epilogue);
  }
  if (pending.rt) run_pending(pending, owed, epilogue);
  _tile_stored(0, pending.c[0], 64);
  if (NB > 1) _tile_stored(1, pending.c[1], 64);
  if (RT > 1) _tile_stored(2, pending.c[2], 64);
  if (RT > 1 && NB > 1) _tile_stored(3, pending.c[3], 64);
  pending.rt0 = rt0;
  pending.block0 = block0;
  pending.second = second;
  pending.rt = RT;
  pending.nb = NB;
  pending.done = 0;
}


// ------------------------------------------------------------------------------------------ AVX2 path

// vpmaddubsw multiplies unsigned by signed bytes into saturating int16 pairs: |x| times w with x's
// sign moved onto w keeps every pair within 2 * 127 * 127 < 32767 (weights and activations lie in
// [-127, 127]), so nothing saturates. Tails go scalar.
inline int32_t hsum_avx2(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

template <int NR, int NO>
inline void tile_avx2(const int8_t* xq, const int8_t* w, int64_t in, int64_t r0, int64_t o, int32_t* acc,
                      int64_t out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a[NR][NO];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NO; ++j) a[r][j] = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= in; i += 32) {
    __m256i wv[NO];
    for (int j = 0; j < NO; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (o + j) * in + i));
    for (int r = 0; r < NR; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r0 + r) * in + i));
      const __m256i xa = _mm256_abs_epi8(xv);
      for (int j = 0; j < NO; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[j], xv));
        a[r][j] = _mm256_add_epi32(a[r][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  if constexpr (NO == 4) {
    if (i == in) {  // no scalar tail: four channels' sums at once
      for (int r = 0; r < NR; ++r) {
        const __m256i s01 = _mm256_hadd_epi32(a[r][0], a[r][1]);
        const __m256i s23 = _mm256_hadd_epi32(a[r][2], a[r][3]);
        const __m256i s = _mm256_hadd_epi32(s01, s23);
        const __m128i q = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(acc + (r0 + r) * out + o), q);
      }
      return;
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NO; ++j) {
      int32_t s = hsum_avx2(a[r][j]);
      for (int64_t t = i; t < in; ++t) s += int32_t{xq[(r0 + r) * in + t]} * int32_t{w[(o + j) * in + t]};
      acc[(r0 + r) * out + o + j] = s;
    }
}

template <int NO>
void block_avx2(const int8_t* xq, const int8_t* w, int64_t rows, int64_t in, int64_t o, int32_t* acc, int64_t out) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) tile_avx2<2, NO>(xq, w, in, r, o, acc, out);
  if (r < rows) tile_avx2<1, NO>(xq, w, in, r, o, acc, out);
}

// ------------------------------------------------------------------------- AVX2, packed weights

// The VNNI layout [O/16][I/4][16][4] read with AVX2 instructions ("avx2-packed"). A block of 16 channels
// is one contiguous run of 16 x I bytes, read front to back: a single stream per thread. Rows [O, I]
// (tile_avx2) read 4 channels' rows side by side, 4 streams I bytes apart, which reached 8.5-9 GB/s from
// memory on an AVX2-only EPYC where the bf16 rows kernel reached 15-17 GB/s. Each 32-byte load holds 4
// consecutive inputs of 8 channels; a row's 4 activation bytes are broadcast, vpmaddubsw with the sign
// trick (as tile_avx2: nothing saturates) gives each channel two pair sums, and vpmaddwd with ones adds
// them into that channel's int32 lane. No horizontal sums. R <= 4 rows share each load of the weights.
// ``xq``: the rows' int8 activations, ``xstride`` (= I/4 * 4) bytes apart, zero past the real inputs.
template <int R>
inline void packed_tile_avx2(const int8_t* xq, int64_t xstride, int64_t r0, const int8_t* wb, int64_t kbs,
                             int32_t* acc, int64_t out, int64_t o0, int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo[R], hi[R];
  const int8_t* xr[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = hi[r] = _mm256_setzero_si256();
    xr[r] = xq + (r0 + r) * xstride;
  }
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kb * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kb * 64 + 32));
    for (int r = 0; r < R; ++r) {
      int32_t word;
      __builtin_memcpy(&word, xr[r] + kb * 4, 4);
      const __m256i xv = _mm256_set1_epi32(word), xa = _mm256_abs_epi8(xv);
      lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w0, xv)), ones));
      hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w1, xv)), ones));
    }
  }
  for (int r = 0; r < R; ++r) {
    int32_t* dst = acc + (r0 + r) * out + o0;
    if (n == 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), lo[r]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8), hi[r]);
    } else {  // the last block of a width that is not a multiple of 16: its real channels only
      alignas(32) int32_t lanes[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), lo[r]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), hi[r]);
      std::copy(lanes, lanes + n, dst);
    }
  }
}

// All rows against packed block b (16 channels), 4 rows at a time.
inline void packed_block_avx2(const int8_t* xq, int64_t xstride, int64_t rows, const int8_t* wb, int64_t kbs,
                              int32_t* acc, int64_t out, int64_t o0, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) packed_tile_avx2<4>(xq, xstride, r, wb, kbs, acc, out, o0, n);
  switch (rows - r) {
    case 3: packed_tile_avx2<3>(xq, xstride, r, wb, kbs, acc, out, o0, n); break;
    case 2: packed_tile_avx2<2>(xq, xstride, r, wb, kbs, acc, out, o0, n); break;
    case 1: packed_tile_avx2<1>(xq, xstride, r, wb, kbs, acc, out, o0, n); break;
    default: break;
  }
}

bool has_vnni() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

// The L1 data cache's size (48 KB where the system does not say): whether a row pair of A tiles stays in
// L1 decides the prompt product's loop order.
int64_t l1_bytes() {
  static const int64_t bytes = [] {
    const long n = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return n > 0 ? static_cast<int64_t>(n) : int64_t{48 * 1024};
  }();
  return bytes;
}

// Rows outer: at most this many pairs of weight blocks per chunk (16 x 2 x 16 channels x 1536 inputs =
// 768 KB of the 1.5B's weights, within a 2 MB L2; 8 and 32 measured slower).
constexpr int64_t kRowsOuterPairs = 16;


// The activations as vpdpbusd / AMX read them: q + 128 as unsigned bytes, in a [padded_rows, width]
// buffer whose padding (rows past q's, columns past its width) holds 128, a zero activation. ``tiled``
// (AMX; width a multiple of 64) lays each 16-row x 64-byte A tile out as one contiguous 1 KB block,
// [row tile][64-input step][16 rows][64 bytes]: a tile load then reads 16 consecutive lines, which the
// hardware prefetchers follow, where rows K bytes apart were 16 separate streams (measured on the 1.5B's
// shapes: 1.07-1.13x for the products alone).
torch::Tensor shifted_activations(const torch::Tensor& q, int64_t padded_rows, int64_t width, bool tiled = false) {
  const int64_t rows = q.size(0), in = q.size(1);
  auto xu = torch::empty({padded_rows, width}, q.options().dtype(torch::kUInt8));
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>());
  uint8_t* xup = xu.data_ptr<uint8_t>();
  const int64_t steps = width / 64;
  at::parallel_for(0, padded_rows, 64, [&](int64_t r0, int64_t r1) {  // each byte written once
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = r < rows ? in : 0;
      const uint8_t* src = qp + r * in;
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      if (tiled) {  // row r's 64-byte pieces, one per step, each in its tile
        uint8_t* row = xup + (r / 16) * 16 * width + (r % 16) * 64;
        for (int64_t k = 0; k < steps; ++k) {
          uint8_t* dst = row + k * 1024;
          if (k * 64 >= n) {  // past the row's inputs (a padding row's every piece): zero activations
            std::memset(dst, 128, 64);
            continue;
          }
          for (int64_t i = 0; i < 64; i += 32) {
            const int64_t c = k * 64 + i;
            if (c + 32 <= n) {
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                                  _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c)), flip));
            } else {
              for (int64_t j = 0; j < 32; ++j) dst[i + j] = c + j < n ? src[c + j] ^ 0x80 : uint8_t{128};
            }
          }
        }
        continue;
      }
      uint8_t* row = xup + r * width;
      int64_t i = 0;
      for (; i + 32 <= n; i += 32)  // (the compiler left the byte loop scalar: 6% of a prompt's time)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + i),
                            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), flip));
      for (; i < n; ++i) row[i] = src[i] ^ 0x80;
      std::fill(row + n, row + width, uint8_t{128});
    }
  });
  return xu;
}

// int32 accumulators [rows, out] of q [rows, in] against w [out, in] on the named path.
torch::Tensor accumulate(const torch::Tensor& q, const torch::Tensor& w, const torch::Tensor& wsum,
                         const std::string& path, const Rescale* rescale = nullptr) {
  const int64_t rows = q.size(0), in = q.size(1), out = wsum.size(0);
  if (w.dim() == 4) {  // packed [O/16, I/4, 16, 4]: the VNNI layout
    const int64_t blocks = w.size(0), kbs = w.size(1), i4 = kbs * 4;
    if (path == "intmm") {  // many rows: back to rows [O, I] for torch's int8 GEMM
      auto rows_major = w.permute({0, 2, 1, 3}).reshape({blocks * 16, i4}).slice(0, 0, out).slice(1, 0, in);
      return at::_int_mm(q, rows_major.t());
    }
    if (path == "amx") {
      TORCH_CHECK(has_amx() && kbs % 16 == 0, "AMX needs the CPU's tiles and inputs packed in 64s");
      const int64_t row_tiles = (rows + 15) / 16;
      // With a rescale the result is fp32, written to rescale->y: no int32 matrix at all.
      auto acc = torch::empty({rescale ? 0 : rows, out}, q.options().dtype(torch::kInt32));
      auto xu = shifted_activations(q, row_tiles * 16, i4, /*tiled=*/true);
      const uint8_t* xup = xu.data_ptr<uint8_t>();
      const int8_t* wp = w.data_ptr<int8_t>();
      const int32_t* sp = wsum.data_ptr<int32_t>();
      int32_t* ap = acc.data_ptr<int32_t>();
      const bool silu = rescale != nullptr && rescale->half > 0;
      TORCH_CHECK(!silu || (row_tiles > 1 && rescale->half % 16 == 0 && 2 * rescale->half == out),
                  "silu(gate) * up on tiles: more than 16 rows, gate and up in whole blocks");
      if (row_tiles > 1) {  // a prompt: 2 x 2 tiles, each pair of channel blocks against every row tile
        // Pairs of neighbouring blocks; for silu(gate) * up, gate block g with up block g + half / 16.
        const int64_t second = silu ? rescale->half / 16 : 1;
        const int64_t pairs = silu ? second : (blocks + 1) / 2;
        auto pair_start = [&](int64_t p) { return silu ? p : 2 * p; };
        const int64_t steps = kbs / 16, row_pairs = (row_tiles + 1) / 2;
        // Pairs outer (below): the pair's weights prefetched a share per step across all row pairs.
        const int64_t per_step = (2 * kbs + row_pairs * steps - 1) / (row_pairs * steps);
        const Epilogue epilogue{sp, ap, rows, out, rescale};
        auto block = [&](Pending& pending, int64_t rt, int64_t b, const std::array<const int8_t*, 2>& next,
                         int64_t first, int64_t lines) {
          const bool rows2 = rt + 1 < row_tiles, two = b + second < blocks;
          if (rows2 && two)
            amx_block<2, 2>(xup, i4, rt, wp, b, second, kbs, epilogue, pending, next, first, lines);
          else if (rows2)
            amx_block<2, 1>(xup, i4, rt, wp, b, second, kbs, epilogue, pending, next, first, lines);
          else if (two)
            amx_block<1, 2>(xup, i4, rt, wp, b, second, kbs, epilogue, pending, next, first, lines);
          else
            amx_block<1, 1>(xup, i4, rt, wp, b, second, kbs, epilogue, pending, next, first, lines);
        };
        auto blocks_of = [&](int64_t p) {  // pair p's two blocks (the second only where it exists)
          const int64_t n = pair_start(p);
          return std::array<const int8_t*, 2>{wp + n * kbs * 64, n + second < blocks ? wp + (n + second) * kbs * 64 : nullptr};
        };
        const std::array<const int8_t*, 2> none = {nullptr, nullptr};
        if (32 * i4 <= l1_bytes()) {
          // Two row tiles of A (32 x I bytes) fit in L1: a chunk of pairs (its weights in L2) against each
          // row pair in turn, the row pair's tiles read from L1 by every pair of the chunk. The first row
          // pair brings the chunk's weights from memory, the next pair's into L2 while this one computes.
          // (The 1.5B's q/k/v and o over a 703-token prompt: 1.09x the pairs-outer order below; its gate/up
          // over 128 rows level; its down, 8960 inputs, 0.9x: that one takes the order below.)
          const int64_t chunk = std::clamp<int64_t>(pairs / (2 * at::get_num_threads()), 1, kRowsOuterPairs);
          const int64_t whole = (2 * kbs + steps - 1) / steps;  // all of a pair's lines over one block's steps
          dynamic_for(pairs, chunk, amx_configure, [&](int64_t p0, int64_t p1) {
            Pending pending;
            for (int64_t rt = 0; rt < row_tiles; rt += 2)
              for (int64_t p = p0; p < p1; ++p) {
                const bool fetch = rt == 0 && p + 1 < p1;
                block(pending, rt, pair_start(p), fetch ? blocks_of(p + 1) : none, 0, fetch ? whole : 0);
              }
            run_pending(pending, 32, epilogue);
          }, amx_release);
          return acc;
        }
        dynamic_for(pairs, 4, amx_configure, [&](int64_t p0, int64_t p1) {
          Pending pending;
          for (int64_t p = p0; p < p1; ++p) {
            const auto next = p + 1 < pairs ? blocks_of(p + 1) : none;  // the next pair's, where they exist
            for (int64_t rt = 0; rt < row_tiles; rt += 2)
              block(pending, rt, pair_start(p), next, rt / 2 * steps * per_step, per_step);
          }
          run_pending(pending, 32, epilogue);
        }, amx_release);
        return acc;
      }
      const int64_t groups = (blocks + 3) / 4;
      dynamic_for(groups, 2, amx_configure, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t b = g * 4;
          if (b + 4 <= blocks) amx_group<4>(xup, i4, row_tiles, wp, b, kbs, sp, ap, rows, out, rescale);
          else
            for (int64_t bb = b; bb < blocks; ++bb)
              amx_group<1>(xup, i4, row_tiles, wp, bb, kbs, sp, ap, rows, out, rescale);
        }
      }, amx_release);
      return acc;
    }
    if (path == "avx2-packed") {
      TORCH_CHECK(has_avx2(), "this CPU lacks AVX2");
      // Inputs past I (the packing pads them to 64s) read zero activations.
      auto xq = i4 == in ? q : at::constant_pad_nd(q, {0, i4 - in}, 0).contiguous();
      auto acc = torch::empty({rows, out}, q.options().dtype(torch::kInt32));
      const int8_t* xp = xq.data_ptr<int8_t>();
      const int8_t* wp = w.data_ptr<int8_t>();
      int32_t* ap = acc.data_ptr<int32_t>();
      at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t o0 = b * 16, n = std::min<int64_t>(16, out - o0);
          if (n > 0) packed_block_avx2(xp, i4, rows, wp + b * kbs * 64, kbs, ap, out, o0, n);
        }
      });
      return acc;
    }
    TORCH_CHECK(path == "vnni" && has_vnni(), "packed int8 weights need the AVX-512 VNNI, AMX or avx2-packed path");
    auto acc = torch::empty({rows, out}, q.options().dtype(torch::kInt32));
    auto xu = shifted_activations(q, rows, i4);
    const uint8_t* xup = xu.data_ptr<uint8_t>();
    static constexpr auto tiles = packed_tiles(std::make_integer_sequence<int, 16>{});
    const int8_t* wp = w.data_ptr<int8_t>();
    const int32_t* sp = wsum.data_ptr<int32_t>();
    int32_t* ap = acc.data_ptr<int32_t>();
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t o0 = b * 16, n = std::min<int64_t>(16, out - o0);
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
          const int64_t tile = std::min<int64_t>(16, rows - r0);
          tiles[tile - 1](xup, i4, r0, wp + b * kbs * 64, kbs, sp + o0, ap, out, o0, valid);
        }
      }
    });
    return acc;
  }
  if (path == "intmm") return at::_int_mm(q, w.t());
  auto acc = torch::empty({rows, out}, q.options().dtype(torch::kInt32));
  int32_t* ap = acc.data_ptr<int32_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const int64_t blocks = (out + kBlock - 1) / kBlock;
  if (path == "vnni-rows") {
    TORCH_CHECK(has_vnni(), "this CPU lacks AVX-512 VNNI");
    auto xu = shifted_activations(q, rows, in);
    const uint8_t* xp = xu.data_ptr<uint8_t>();
    const int32_t* sp = wsum.data_ptr<int32_t>();
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t o = b * kBlock;
        if (o + kBlock <= out) block_vnni<kBlock>(xp, wp, sp, rows, in, o, ap, out);
        else
          for (int64_t c = o; c < out; ++c) block_vnni<1>(xp, wp, sp, rows, in, c, ap, out);
      }
    });
  } else if (path == "avx2") {
    TORCH_CHECK(has_avx2(), "this CPU lacks AVX2");
    const int8_t* xp = q.data_ptr<int8_t>();
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t o = b * kBlock;
        if (o + kBlock <= out) block_avx2<kBlock>(xp, wp, rows, in, o, ap, out);
        else
          for (int64_t c = o; c < out; ++c) block_avx2<1>(xp, wp, rows, in, c, ap, out);
      }
    });
  } else {
    TORCH_CHECK(false, "unknown int8 path '", path, "'");
  }
  return acc;
}

}  // namespace

// (q, scale) of x's rows; ``lanes`` 8 forces the AVX2 loop (tests compare it with the 16-lane one).
std::vector<torch::Tensor> quantize_rows_with(torch::Tensor x, int64_t lanes) {
  auto x2 = x.reshape({-1, x.size(-1)}).to(torch::kFloat32).contiguous();
  const int64_t rows = x2.size(0), in = x2.size(1);
  auto q = torch::empty({rows, in}, x2.options().dtype(torch::kInt8));
  auto scale = torch::empty({rows}, x2.options());
  quantize_rows_impl(x2.data_ptr<float>(), rows, in, q.data_ptr<int8_t>(), scale.data_ptr<float>(), static_cast<int>(lanes));
  return {q, scale};
}

std::vector<torch::Tensor> quantize_rows(torch::Tensor x) { return quantize_rows_with(x, 16); }

// For the other kernel files (int4_linear.cpp): the CPU check the VNNI paths here use.
bool cpu_has_avx512_vnni() { return has_vnni(); }

std::vector<std::string> int8_paths() {
  std::vector<std::string> paths;
  if (has_amx()) paths.push_back("amx");
  if (has_vnni()) {
    paths.push_back("vnni");
    paths.push_back("vnni-rows");
  }
  if (has_avx2()) {
    paths.push_back("avx2-packed");
    paths.push_back("avx2");
  }
  paths.push_back("intmm");
  return paths;
}

namespace {
void check_accumulate(const torch::Tensor& q, const torch::Tensor& w, const torch::Tensor& wsum) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), "q: contiguous int8 [M, I]");
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.is_contiguous(), "w: contiguous int8");
  if (w.dim() == 2) {
    TORCH_CHECK(w.size(1) == q.size(1) && wsum.numel() == w.size(0), "w: [O, I] rows");
  } else {
    TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 4 && w.size(1) * 4 >= q.size(1) &&
                w.size(0) * 16 >= wsum.numel(), "w: packed [O/16, I/4, 16, 4]");
  }
  TORCH_CHECK(wsum.scalar_type() == torch::kInt32 && wsum.is_contiguous(), "wsum: int32 [O]");
}
}  // namespace

torch::Tensor int8_accumulate(torch::Tensor q, torch::Tensor w, torch::Tensor wsum, std::string path) {
  check_accumulate(q, w, wsum);
  return accumulate(q, w, wsum, path);
}

// The whole product: quantize the rows, accumulate on ``path``, y = (acc * x_scale) * w_scale (+ bias),
// the same fp32 operations in the same order as the torch fallback in kernels/__init__.py. With ``half``
// > 0 (AMX tiles only, no bias: see silu_on_tiles) y = silu(gate) * up of the [gate | up] product instead.
torch::Tensor int8_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& w_scale,
                           const torch::Tensor& wsum, const c10::optional<torch::Tensor>& bias,
                           const std::string& path, int64_t half) {
  const int64_t out = wsum.numel(), width = half > 0 ? half : out;
  auto quantized = quantize_rows(x);
  const int64_t rows = quantized[0].size(0);
  auto y = torch::empty({rows, width}, quantized[1].options());
  const float* xs = quantized[1].data_ptr<float>();
  auto ws_c = w_scale.to(torch::kFloat32).contiguous();
  const float* ws = ws_c.data_ptr<float>();
  torch::Tensor b_c;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b_c = bias->to(torch::kFloat32).contiguous();
    bp = b_c.data_ptr<float>();
  }
  float* yp = y.data_ptr<float>();
  auto shape = x.sizes().vec();
  shape.back() = width;
  if (path == "amx" && w.dim() == 4) {  // AMX: the epilogue rescales (the loop below, lane by lane)
    const Rescale rescale{xs, ws, bp, yp, half};
    check_accumulate(quantized[0], w, wsum);
    accumulate(quantized[0], w, wsum, path, &rescale);
    return y.view(shape);
  }
  TORCH_CHECK(half == 0, "silu(gate) * up in the product's epilogue needs AMX tiles");
  auto acc = int8_accumulate(quantized[0], w, wsum, path).contiguous();
  const int32_t* ap = acc.data_ptr<int32_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t o = 0; o < out; ++o) {
        float v = static_cast<float>(ap[r * out + o]) * xs[r];
        v = v * ws[o];
        if (bp) v = v + bp[o];
        yp[r * out + o] = v;
      }
  });
  return y.view(shape);
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor wsum,
                          c10::optional<torch::Tensor> bias, std::string path) {
  return int8_product(x, w, w_scale, wsum, bias, path, 0);
}

torch::Tensor silu_mul(torch::Tensor gate_up);

bool silu_on_tiles(const torch::Tensor& x, const torch::Tensor& w, int64_t out, const std::string& path) {
  const int64_t rows = x.numel() / x.size(-1);
  return path == "amx" && w.dim() == 4 && rows > 16 && out % 32 == 0 && has_amx();
}

// silu(gate) * up of a fused [gate | up] int8 projection without a bias: on AMX tiles for more than 16 rows
// (a prompt) in one pass, the silu applied in the product's epilogue (amx_silu); otherwise int8_linear
// then silu_mul. The same bits either way.
torch::Tensor int8_gate_up_silu(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor wsum,
                                std::string path) {
  const int64_t out = wsum.numel();
  if (!silu_on_tiles(x, w, out, path)) return silu_mul(int8_linear(x, w, w_scale, wsum, c10::nullopt, path));
  return int8_product(x, w, w_scale, wsum, c10::nullopt, path, out / 2);
}
