// The own int8 product's tiles and row quantization (int8_rows.cpp tells why they are shaped so), shared by the
// product and by the native lean pass (starjar/model/native/lean_pass.cpp), which calls them inside its threads.
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
  for (int r = 0; r < RB; ++r) {
    const float sx = j.scale_x[r0 + r], zx = j.zero_x[r0 + r];
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t n = n0 + i;
      const float v = static_cast<float>(sums[r][i]) - zx * j.sum_w[n];
      const float out = v * sx * j.scale_w[n];
      j.y[(r0 + r) * j.N + n] = j.b != nullptr ? out + j.b[n] : out;
    }
  }
}

using Tile = void (*)(const Job&, int64_t, int64_t, int64_t);
constexpr Tile TILES[RMAX] = {tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

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

// Tiles [t0, t1) of the job for every input row.
inline void int8_range(const Job& j, int64_t R, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * NB, nb = std::min<int64_t>(NB, j.N - n0);
    for (int64_t r0 = 0; r0 < R; r0 += RMAX) TILES[std::min<int64_t>(RMAX, R - r0) - 1](j, r0, n0, nb);
  }
}

}  // namespace starjar_int8
