// The lean pass's AVX2 vector steps (lean_pass.cpp): e^x in 8 lanes, one query head's attention with the head
// in registers and four keys' scores reduced at once, and silu(g) * u. CPUs without AVX-512 (AMD Zen 2/3,
// Intel client parts) run these; the AVX-512 ones sit beside them in lean_pass.cpp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../../cpu/native/tiles.h"

namespace starjar_lean_avx2 {

// e^x in 8 lanes as exp512 computes it (x = n ln2 + r, e^r by its Taylor polynomial of degree 7), 2^n built
// in the exponent bits (AVX2 has no scalef); lanes below -87 (hidden keys, SiLU's far tail) give 0.
__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 live = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts: r exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 poly = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(c));
  }
  // n lies in [-126, 127] here: 2^n is a normal float with exponent bits n + 127.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(poly, _mm256_castsi256_ps(bits)), live);
}

// The four dot products a[0..3] . q (each over 8 C floats) reduced together: [a0, a1, a2, a3].
template <int C>
__attribute__((target("avx2,fma"))) inline __m128 dots4(const __m256* qv, const float* k0, const float* k1,
                                                        const float* k2, const float* k3) {
  __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k1));
  __m256 a2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k3));
  for (int c = 1; c < C; ++c) {
    a0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), a0);
    a1 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k1 + 8 * c), a1);
    a2 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k2 + 8 * c), a2);
    a3 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k3 + 8 * c), a3);
  }
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// One query head's attention over a head of 8 C floats (q and the output in registers): the scores
// (q . k scaling + mask; hidden keys -inf) four keys at a time, their exponentials 8 at a time, then p v summed;
// out = that / sum. sc holds n floats.
template <int C>
__attribute__((target("avx2,fma"))) void attend_head256(const float* q, const float* keys, int64_t kstride,
                                                       const float* vals, int64_t vstride, const float* m,
                                                       int64_t mstride, int64_t n, float scaling, float* sc,
                                                       float* out) {
  const float hidden = std::numeric_limits<float>::lowest() / 2, none = -std::numeric_limits<float>::infinity();
  __m256 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  float top = none;
  int64_t s = 0;
  for (; s < n; s += 4) {  // past the last key the last one again: every key's sum in the same order
    const float* kr[4];
    for (int i = 0; i < 4; ++i) kr[i] = keys + std::min<int64_t>(s + i, n - 1) * kstride;
    alignas(16) float four[4];
    _mm_store_ps(four, dots4<C>(qv, kr[0], kr[1], kr[2], kr[3]));
    for (int64_t i = 0; i < std::min<int64_t>(4, n - s); ++i) {
      const float add = m != nullptr ? m[(s + i) * mstride] : 0.0f;
      sc[s + i] = add <= hidden ? none : four[i] * scaling + add;
      top = std::max(top, sc[s + i]);
    }
  }
  if (top == none) {  // no key visible
    std::fill(out, out + 8 * C, 0.0f);
    return;
  }
  const __m256 tv = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  for (s = 0; s < n; s += 8) {
    const int64_t len = std::min<int64_t>(8, n - s);
    alignas(32) float part[8];
    std::fill(part, part + 8, none);  // past the last key: e^-inf = 0
    std::copy(sc + s, sc + s + len, part);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(part), tv));
    _mm256_store_ps(part, e);
    std::copy(part, part + len, sc + s);
    sum = _mm256_add_ps(sum, e);
  }
  __m256 ov[C];
  for (int c = 0; c < C; ++c) ov[c] = _mm256_setzero_ps();
  for (s = 0; s < n; ++s) {
    if (sc[s] == 0.0f) continue;
    const __m256 pv = _mm256_set1_ps(sc[s]);
    const float* vr = vals + s * vstride;
    for (int c = 0; c < C; ++c) ov[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * c), ov[c]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / starjar_tiles::reduce256(sum));
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(ov[c], inv));
}

// silu(g) * u over n elements with AVX2, the last ones through a full vector: every element's value the same
// wherever a range of them starts or ends.
__attribute__((target("avx2,fma"))) inline __m256 silu_mul8(__m256 x, __m256 u) {
  const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), x)));
  return _mm256_mul_ps(_mm256_div_ps(x, den), u);
}

__attribute__((target("avx2,fma"))) inline void silu_mul256(const float* g, const float* u, float* out, int64_t n) {
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) _mm256_storeu_ps(out + e, silu_mul8(_mm256_loadu_ps(g + e), _mm256_loadu_ps(u + e)));
  if (e == n) return;
  alignas(32) float gs[8] = {}, us[8] = {}, res[8];
  std::copy(g + e, g + n, gs);
  std::copy(u + e, u + n, us);
  _mm256_store_ps(res, silu_mul8(_mm256_load_ps(gs), _mm256_load_ps(us)));
  std::copy(res, res + (n - e), out + e);
}

}  // namespace starjar_lean_avx2
