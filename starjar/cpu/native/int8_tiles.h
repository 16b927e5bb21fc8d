// The own int8 product's tiles and row quantization (int8_rows.cpp tells why they are shaped so), shared by the
// product and by the native lean pass (starjar/model/native/lean_pass.cpp), which calls them inside its threads:
// AVX-512 VNNI's, and AVX2's for CPUs without it (the same int32 sums, so the same outputs).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

namespace starjar_int8 {

constexpr int64_t NB = 4;    // weight rows a tile holds
constexpr int64_t KB = 64;   // bytes a VNNI step takes; K is padded to a multiple of it
constexpr int RMAX = 6;      // input rows a tile holds

inline bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

inline bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

struct Job {
  const uint8_t* xq;     // [R, Kp], each row quantized over its own range
  const float* scale_x;  // [R]
  const float* zero_x;   // [R]: each row's zero point
  const int8_t* w;       // [N, Kp]
  const float* scale_w;  // [N]
  const float* sum_w;    // [N]: sum over k of W[n, k]
  const float* b;        // [N] or null
  float* y;              // [R, N]
  int64_t Kp, N;
};

// One output of a tile: the int32 sum back to float with the row's zero point, scales and bias. The fused
// multiply-adds are written out: left to the compiler, a VNNI tile's partial last tile and AVX2's differed in
// which products it fused (one ulp apart on a 2-core AMD EPYC, Zen 4).
inline void store(const Job& j, int64_t r, int64_t n, int32_t sum) {
  const float v = std::fma(-j.zero_x[r], j.sum_w[n], static_cast<float>(sum));
  const float scaled = v * j.scale_x[r];
  j.y[r * j.N + n] = j.b != nullptr ? std::fma(scaled, j.scale_w[n], j.b[n]) : scaled * j.scale_w[n];
}

// Outputs [n0, n0 + nb) for input rows [r0, r0 + RB).
template <int RB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile(const Job& j, int64_t r0, int64_t n0, int64_t nb) {
  __m512i acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NB; ++i) acc[r][i] = _mm512_setzero_si512();
  const int8_t* wr[NB];
  for (int i = 0; i < NB; ++i) wr[i] = j.w + (n0 + std::min<int64_t>(i, nb - 1)) * j.Kp;
  for (int64_t k = 0; k < j.Kp; k += KB) {
    __m512i wv[NB];
    for (int i = 0; i < NB; ++i) {
      wv[i] = _mm512_loadu_si512(wr[i] + k);
      if (r0 == 0) _mm_prefetch(reinterpret_cast<const char*>(wr[i] + NB * j.Kp + k), _MM_HINT_T0);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512i xv = _mm512_loadu_si512(j.xq + (r0 + r) * j.Kp + k);
      for (int i = 0; i < NB; ++i) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], xv, wv[i]);
    }
  }
  int32_t sums[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NB; ++i) sums[r][i] = _mm512_reduce_add_epi32(acc[r][i]);
  for (int r = 0; r < RB; ++r)
    for (int64_t i = 0; i < nb; ++i) store(j, r0 + r, n0 + i, sums[r][i]);
}

// The same outputs, each weight row summed against every input row before the next: one stream a thread. The
// int32 sums are exact, so the outputs are tile's bits. On a 2-core AMD EPYC (Zen 4), one thread, the default
// draft's body products over one input row took 5.1-5.9 ms so against 10.5-10.9 interleaved, over 2 rows
// 4.8-5.9 against 14.8-15.1. Over several rows each step also asks for the weights 16 KB ahead into L2, as the
// float product does (tiles.h's row512): 4 rows 6.9-9.9 ms against 7.9-10.6 without. Which runs for how many
// rows is measured per machine (starjar.cpu.few_rows.settle_int8_stream).
constexpr int64_t L2_AHEAD = 16384;  // bytes

template <int RB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void stream_tile(const Job& j, int64_t r0, int64_t n0,
                                                                      int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    __m512i acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_si512();
    const int8_t* wr = j.w + (n0 + i) * j.Kp;
    for (int64_t k = 0; k < j.Kp; k += KB) {
      const __m512i wv = _mm512_loadu_si512(wr + k);
      if constexpr (RB > 1) _mm_prefetch(reinterpret_cast<const char*>(wr + L2_AHEAD + k), _MM_HINT_T1);
      for (int r = 0; r < RB; ++r) {
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(j.xq + (r0 + r) * j.Kp + k), wv);
      }
    }
    for (int r = 0; r < RB; ++r) store(j, r0 + r, n0 + i, _mm512_reduce_add_epi32(acc[r]));
  }
}

using Tile = void (*)(const Job&, int64_t, int64_t, int64_t);
constexpr Tile TILES[RMAX] = {tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};
constexpr Tile STREAM_TILES[RMAX] = {stream_tile<1>, stream_tile<2>, stream_tile<3>,
                                     stream_tile<4>, stream_tile<5>, stream_tile<6>};

// Two streams a thread, as the float product's twin512 (tiles.h): weight rows [a0, a1) and [c0, c1) (rows, not
// tiles) against RB (1..RMAX) input rows, row a0 + i beside row c0 + i, each asked for TWIN_AHEAD bytes on into L2,
// then the longer range's rest one row at a time. The int32 sums are exact, so the outputs are tile's bits. One
// stream leaves a core short of reads in flight: on a 2-core AMD EPYC (Zen 4), one thread, a 134 MB int8 weight
// against one input row read 23.3 GB/s so against 19.1 as one run (a plain read: 24.6; 2 KB ahead: 22.2). Which row
// counts take it is measured per machine (starjar.cpu.few_rows.settle_int8_stream).
constexpr int64_t TWIN_AHEAD = 1024;  // bytes
constexpr int64_t TWIN_BIT = 6;  // an int8 stream mask here: bit RB - 1 streams RB rows, bit TWIN_BIT + RB - 1 twins
static_assert(TWIN_BIT == 6, "tiles.h's int8_bits puts the twin bits at bit 6");

template <int RB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void twin_rows(const Job& j, int64_t a0, int64_t a1,
                                                                    int64_t c0, int64_t c1) {
  const int64_t both = std::min(a1 - a0, c1 - c0);
  for (int64_t i = 0; i < both; ++i) {
    __m512i p[RB], q[RB];
    for (int r = 0; r < RB; ++r) p[r] = q[r] = _mm512_setzero_si512();
    const int8_t* wa = j.w + (a0 + i) * j.Kp;
    const int8_t* wc = j.w + (c0 + i) * j.Kp;
    for (int64_t k = 0; k < j.Kp; k += KB) {
      const __m512i va = _mm512_loadu_si512(wa + k), vc = _mm512_loadu_si512(wc + k);
      _mm_prefetch(reinterpret_cast<const char*>(wa + TWIN_AHEAD + k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(wc + TWIN_AHEAD + k), _MM_HINT_T1);
      for (int r = 0; r < RB; ++r) {
        const __m512i xv = _mm512_loadu_si512(j.xq + r * j.Kp + k);
        p[r] = _mm512_dpbusd_epi32(p[r], xv, va);
        q[r] = _mm512_dpbusd_epi32(q[r], xv, vc);
      }
    }
    for (int r = 0; r < RB; ++r) {
      store(j, r, a0 + i, _mm512_reduce_add_epi32(p[r]));
      store(j, r, c0 + i, _mm512_reduce_add_epi32(q[r]));
    }
  }
  if (a0 + both < a1) stream_tile<RB>(j, 0, a0 + both, a1 - a0 - both);
  if (c0 + both < c1) stream_tile<RB>(j, 0, c0 + both, c1 - c0 - both);
}

using Twin = void (*)(const Job&, int64_t, int64_t, int64_t, int64_t);
constexpr Twin TWINS[RMAX] = {twin_rows<1>, twin_rows<2>, twin_rows<3>, twin_rows<4>, twin_rows<5>, twin_rows<6>};

// The AVX2 tile (no VNNI): 16 bytes at a time widened to 16 bits and multiplied in pairs into int32 (madd),
// which never saturates, so each sum is the exact int32 VNNI's dpbusd gives and the outputs are its bits. A
// tile's weight rows are taken one after another, 32 bytes a step into 2 accumulators per input row: one
// stream a thread, which the hardware prefetcher follows best (a chain of the default draft's products on a
// 2-core AMD EPYC: 4.2 against 4.7 ms with the 4 rows interleaved).
constexpr int RMAX2 = 2;

__attribute__((target("avx2,fma"))) inline int32_t reduce_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

__attribute__((target("avx2,fma"))) inline __m256i widened(const void* p, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
}

template <int RB>
__attribute__((target("avx2,fma"))) void tile_avx2(const Job& j, int64_t r0, int64_t n0, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    __m256i acc[RB][2];
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int8_t* wr = j.w + (n0 + i) * j.Kp;
    for (int64_t k = 0; k < j.Kp; k += 32) {
      const __m256i w0 = widened(wr + k, true), w1 = widened(wr + k + 16, true);
      for (int r = 0; r < RB; ++r) {
        const uint8_t* xr = j.xq + (r0 + r) * j.Kp + k;
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(widened(xr, false), w0));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(widened(xr + 16, false), w1));
      }
    }
    for (int r = 0; r < RB; ++r) store(j, r0 + r, n0 + i, reduce_epi32(_mm256_add_epi32(acc[r][0], acc[r][1])));
  }
}

constexpr Tile TILES_AVX2[RMAX2] = {tile_avx2<1>, tile_avx2<2>};

// Row r of x [R, K] quantized into xq [R, Kp] over its own range [min(x, 0), max(x, 0)] in 255 steps, as
// torch's dynamic kernel quantizes one tensor (a mostly positive row, as SiLU gives the down projection, keeps
// all 256 levels); the padding is the zero point, which contributes nothing once it is subtracted. Returns
// (scale, zero point). q = x / scale, rounded to nearest (ties to even), plus the zero point, within [0, 255].
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline std::pair<float, int32_t> quantize_row(
    const float* x, int64_t K, int64_t Kp, uint8_t* xq) {
  __m512 lo16 = _mm512_setzero_ps(), hi16 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= K; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    lo16 = _mm512_min_ps(lo16, v);
    hi16 = _mm512_max_ps(hi16, v);
  }
  float lo = _mm512_reduce_min_ps(lo16), hi = _mm512_reduce_max_ps(hi16);
  for (; i < K; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  const float scale = hi > lo ? (hi - lo) / 255.0f : 1.0f;
  const int32_t zero = static_cast<int32_t>(std::min(255.0f, std::max(0.0f, std::nearbyint(-lo / scale))));
  const __m512 inv16 = _mm512_set1_ps(1.0f / scale);
  const __m512i zero16 = _mm512_set1_epi32(zero), top = _mm512_set1_epi32(255), bottom = _mm512_setzero_si512();
  for (i = 0; i + 16 <= K; i += 16) {
    __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv16)), zero16);
    q = _mm512_min_epi32(_mm512_max_epi32(q, bottom), top);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i), _mm512_cvtepi32_epi8(q));
  }
  for (; i < K; ++i) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(x[i] * (1.0f / scale))) + zero;
    xq[i] = static_cast<uint8_t>(std::min(255, std::max(0, q)));
  }
  std::fill(xq + K, xq + Kp, static_cast<uint8_t>(zero));
  return {scale, zero};
}

// quantize_row with AVX2: the same range, scale, rounding and clamping, so the same bytes.
__attribute__((target("avx2,fma"))) inline std::pair<float, int32_t> quantize_row_avx2(const float* x, int64_t K,
                                                                                       int64_t Kp, uint8_t* xq) {
  __m256 lo8 = _mm256_setzero_ps(), hi8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    lo8 = _mm256_min_ps(lo8, v);
    hi8 = _mm256_max_ps(hi8, v);
  }
  alignas(32) float los[8], his[8];
  _mm256_store_ps(los, lo8);
  _mm256_store_ps(his, hi8);
  float lo = *std::min_element(los, los + 8), hi = *std::max_element(his, his + 8);
  for (; i < K; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  const float scale = hi > lo ? (hi - lo) / 255.0f : 1.0f;
  const int32_t zero = static_cast<int32_t>(std::min(255.0f, std::max(0.0f, std::nearbyint(-lo / scale))));
  const __m256 inv8 = _mm256_set1_ps(1.0f / scale);
  const __m256i zero8 = _mm256_set1_epi32(zero), top = _mm256_set1_epi32(255), bottom = _mm256_setzero_si256();
  alignas(32) int32_t q8[8];
  for (i = 0; i + 8 <= K; i += 8) {
    __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv8)), zero8);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q8), _mm256_min_epi32(_mm256_max_epi32(q, bottom), top));
    for (int e = 0; e < 8; ++e) xq[i + e] = static_cast<uint8_t>(q8[e]);
  }
  for (; i < K; ++i) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(x[i] * (1.0f / scale))) + zero;
    xq[i] = static_cast<uint8_t>(std::min(255, std::max(0, q)));
  }
  std::fill(xq + K, xq + Kp, static_cast<uint8_t>(zero));
  return {scale, zero};
}

// Tiles [t0, t1) of the job for every input row, with VNNI's tiles or (vnni false) AVX2's; VNNI's streamed
// (stream_tile) for a call over RB <= RMAX input rows where bit RB - 1 of stream_mask is set (a call over more
// rows keeps the interleaved tile, as the float product does: tiles.h's isa_of).
inline void int8_range(const Job& j, int64_t R, int64_t t0, int64_t t1, bool vnni = true, int64_t stream_mask = 0) {
  const int rmax = vnni ? RMAX : RMAX2;
  const bool few = R <= rmax;
  Tile tiles[RMAX];
  for (int i = 0; i < rmax; ++i) {
    tiles[i] = !vnni ? TILES_AVX2[i] : few && ((stream_mask >> i) & 1) ? STREAM_TILES[i] : TILES[i];
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * NB, nb = std::min<int64_t>(NB, j.N - n0);
    for (int64_t r0 = 0; r0 < R; r0 += rmax) tiles[std::min<int64_t>(rmax, R - r0) - 1](j, r0, n0, nb);
  }
}

// Whether a call over R input rows walks two runs of weight rows at once: VNNI's streamed rows with the twin bit.
inline bool twins(int64_t R, bool vnni, int64_t stream_mask) {
  return vnni && R >= 1 && R <= RMAX && ((stream_mask >> (R - 1)) & (stream_mask >> (TWIN_BIT + R - 1)) & 1);
}

// Tiles [a0, a1) and [c0, c1) of the job for every input row: in one walk of two runs where the call twins
// (twin_rows), else one range after the other (int8_range).
inline void int8_two(const Job& j, int64_t R, int64_t a0, int64_t a1, int64_t c0, int64_t c1, bool vnni,
                     int64_t stream_mask) {
  if (twins(R, vnni, stream_mask) && a0 < a1 && c0 < c1) {
    TWINS[R - 1](j, a0 * NB, std::min(a1 * NB, j.N), c0 * NB, std::min(c1 * NB, j.N));
    return;
  }
  if (a0 < a1) int8_range(j, R, a0, a1, vnni, stream_mask);
  if (c0 < c1) int8_range(j, R, c0, c1, vnni, stream_mask);
}

// A row quantized by the kernels the job runs: the same bytes either way.
inline std::pair<float, int32_t> quantize(const float* x, int64_t K, int64_t Kp, uint8_t* xq, bool vnni) {
  return vnni ? quantize_row(x, K, Kp, xq) : quantize_row_avx2(x, K, Kp, xq);
}

}  // namespace starjar_int8
