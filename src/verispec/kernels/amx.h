// Intel AMX plumbing shared by the kernels: whether this CPU (and Linux) lets the process use the tiles,
// the tile configuration every AMX kernel here runs with, and a dynamic split of work over threads.
#pragma once
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

// AMX tiles with int8 multiplies (CPUID.7.0:EDX bits 24, 25), the tile state granted by Linux.
inline bool has_amx() {
  static const bool yes = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    if (!tile || !int8) return false;
    constexpr long kReqPerm = 0x1023, kXtiledata = 18;  // Linux: ask for the tile state once per process
    return syscall(SYS_arch_prctl, kReqPerm, kXtiledata) == 0;
  }();
  return yes;
}

// ... and bf16 multiplies (EDX bit 22) with AVX-512 BF16 conversions (CPUID.7.1:EAX bit 5).
inline bool has_amx_bf16() {
  static const bool yes = [] {
    unsigned a, b, c, d;
    if (!has_amx() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1)) return false;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
  }();
  return yes;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every AMX kernel here uses 8 tiles of 16 rows x 64 bytes: C tiles 0-3 (16 x 16 int32 or fp32), A and B
// tiles 4-7 (16 rows x 64 int8 or 32 bf16).
__attribute__((target("amx-tile"))) inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  // GCC 12 does not see that ldtilecfg reads all 64 bytes and drops the stores above without this.
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }

// Work items [0, n) handed out ``chunk`` at a time to whichever thread asks next, each thread calling
// setup() first and teardown() last (the AMX tile state is per thread). On a shared machine one core is
// often slower than the other; with a static split the faster one waited (OpenMP's barrier spin was 8%
// of a prompt's time). Which thread computes a block changes no bits.
template <class Setup, class Fn, class Teardown>
void dynamic_for(int64_t n, int64_t chunk, Setup setup, Fn fn, Teardown teardown) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    setup();
    for (int64_t b; (b = next.fetch_add(chunk)) < n;) fn(b, std::min(n, b + chunk));
    teardown();
  });
}

}  // namespace
