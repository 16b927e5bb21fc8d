// The few-row product's tiles (few_rows.cpp tells why they are shaped so), shared by the product and by the
// native lean pass (starjar/model/native/lean_pass.cpp), which calls them inside its own threads.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace starjar_tiles {

constexpr int64_t NB = 4;  // weight rows a tile holds
// A stream mask (starjar.cpu.few_rows): bits 0-5 the float products' row counts, bits 6-11 the int8 ones', bits
// 12-17 the float row counts 7..12 that take the wide tiles (wide512), bits 18-23 the streamed float row counts that
// walk two runs of weight rows at once (twin512), bits 24-29 the streamed int8 row counts that do (int8_tiles.h's
// twin_rows).
constexpr int64_t INT8_STREAM_SHIFT = 6;
constexpr int64_t WIDE_SHIFT = 12;
constexpr int64_t TWIN_SHIFT = 18;
constexpr int64_t INT8_TWIN_SHIFT = 24;
constexpr int64_t MASK_BITS = 30;

// The int8 kernels' own mask (int8_tiles.h) from a stream mask: its stream bits, then its twin bits from bit 6
// (int8_tiles.h's TWIN_BIT, checked there).
inline int64_t int8_bits(int64_t mask) {
  return ((mask >> INT8_STREAM_SHIFT) & 63) | ((mask >> INT8_TWIN_SHIFT) & 63) << 6;
}

// A tile's sums [rb][NB] into y, the bias added: only the tile's nb real outputs.
inline void store(const float* sums, int rb, const float* b, float* y, int64_t N, int64_t r0, int64_t n0,
                  int64_t nb) {
  for (int r = 0; r < rb; ++r) {
    for (int64_t j = 0; j < nb; ++j) {
      const float s = sums[r * NB + j];
      y[(r0 + r) * N + n0 + j] = b != nullptr ? s + b[n0 + j] : s;
    }
  }
}

// The AVX-512 tile: outputs [n0, n0 + nb) (nb 1..4) for input rows [r0, r0 + RB).
template <int RB>
__attribute__((target("avx512f"))) void tile512(const float* x, const float* w, const float* b, float* y,
                                                int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t nb) {
  __m512 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = w + (n0 + std::min<int64_t>(j, nb - 1)) * K;
  const int64_t full = K - K % 16;
  for (int64_t k = 0; k < full; k += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_loadu_ps(wr[j] + k);
      // The first input rows prefetch the next tile; later ones, summing from L1, the tile after into L2.
      if (r0 == 0) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + NB * K + k), _MM_HINT_T0);
      else _mm_prefetch(reinterpret_cast<const char*>(wr[j] + 2 * NB * K + k), _MM_HINT_T1);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + (r0 + r) * K + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (full < K) {  // the last lanes, the rest zero: each lane's sum in the same order as a full one's
    const __mmask16 m = static_cast<__mmask16>((1u << (K - full)) - 1);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(m, wr[j] + full);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + (r0 + r) * K + full);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  // Reduced with constant bounds, so the accumulators stay in registers; then the nb real outputs written.
  float sums[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  store(sums[0], RB, b, y, N, r0, n0, nb);
}

// A vector of 8 lanes summed to one float.
__attribute__((target("avx2,fma"))) inline float reduce256(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The AVX2 kernel streams one weight row at a time: on a 2-core AMD EPYC (Zen 3) a chain of the default
// target's products streamed 29 GB/s against 21-23 with 4 rows interleaved (with or without the next tile
// prefetched): the hardware prefetcher follows one stream a thread best. Each output is summed in 2 lanes of
// 8 over k in steps of 16 (an 8-lane chunk past the last full step into the first lane), the lanes added and
// reduced, then the tail past the last 8 one by one: the same order for any RB. Two lanes, not four, leave
// registers for 6 input rows against each weight row (12 accumulators): on that EPYC, one thread, the
// target's products over 8 rows took 66-78 ms this way against 86-90 with 4 lanes and 3 rows a pass, over 4
// rows 39-50 against 48-51, one row 32-36 against 31-34. The later rows read the weight row from L1.
template <int RB>
__attribute__((target("avx2,fma"))) void row256(const float* x, const float* w, const float* b, float* y,
                                                int64_t K, int64_t N, int64_t r0, int64_t n) {
  __m256 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* wr = w + n * K;
  const int64_t steps = K - K % 16, full = K - K % 8;
  for (int64_t k = 0; k < steps; k += 16) {
    for (int c = 0; c < 2; ++c) {
      const __m256 wv = _mm256_loadu_ps(wr + k + 8 * c);
      for (int r = 0; r < RB; ++r) {
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (r0 + r) * K + k + 8 * c), wv, acc[r][c]);
      }
    }
  }
  if (steps < full) {
    const __m256 wv = _mm256_loadu_ps(wr + steps);
    for (int r = 0; r < RB; ++r) {
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (r0 + r) * K + steps), wv, acc[r][0]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    float s = reduce256(_mm256_add_ps(acc[r][0], acc[r][1]));
    for (int64_t k = full; k < K; ++k) s += x[(r0 + r) * K + k] * wr[k];
    y[(r0 + r) * N + n] = b != nullptr ? s + b[n] : s;
  }
}

// The AVX-512 tile's sums for one weight row at a time: one lane of 16 over k, the masked tail, reduce_add, the
// tile's order exactly, so a row's values do not depend on which of the two ran. On a 2-core AMD EPYC (Zen 4),
// one thread, the default target's 211 products over one input row took 23-26 ms streamed so against 39-44
// with 4 weight rows interleaved (the hardware prefetcher follows one stream a thread best, as on Zen 3); over
// 8 rows the interleaved tile was faster (40-45 against 74-76). Over several rows the sums cost as long as the
// stream and the two did not overlap (4 rows: 35-42 ms) until each step also asked for the weights 64 KB ahead
// into L2 (25-27 ms); one row is faster without it. Which runs for how many rows is measured per machine
// (starjar.cpu.few_rows.settle_stream).
constexpr int64_t L2_AHEAD = 16384;  // floats

template <int RB>
__attribute__((target("avx512f"))) void row512(const float* x, const float* w, const float* b, float* y,
                                               int64_t K, int64_t N, int64_t r0, int64_t n) {
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  const float* wr = w + n * K;
  const int64_t full = K - K % 16;
  for (int64_t k = 0; k < full; k += 16) {
    const __m512 wv = _mm512_loadu_ps(wr + k);
    if constexpr (RB > 1) _mm_prefetch(reinterpret_cast<const char*>(wr + L2_AHEAD + k), _MM_HINT_T1);
    for (int r = 0; r < RB; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (r0 + r) * K + k), wv, acc[r]);
  }
  if (full < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - full)) - 1);
    const __m512 wv = _mm512_maskz_loadu_ps(m, wr + full);
    for (int r = 0; r < RB; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + (r0 + r) * K + full), wv, acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    const float s = _mm512_reduce_add_ps(acc[r]);
    y[(r0 + r) * N + n] = b != nullptr ? s + b[n] : s;
  }
}

// Two weight rows, n0 and n1, against all RB input rows of a call (2 RB sums in registers), the tile's order for each
// output, so the values are those of the other tiles; m = 1 keeps only n0's sums. Each step asks for both rows' weights
// AHEAD floats on into L2. Over 7..12 rows it pairs neighbouring rows (wide512). A call over 7-8 rows otherwise
// runs a 6-row pass and a short one over each tile, and its sums do not overlap the weight stream: on a 2-core AMD
// EPYC (Zen 4), one thread, a
// 226 MB weight's product took 14-17 ms over 8 rows that way against 12.6-12.9 in one pass like this (7 rows:
// 14.3-15.0 against 10.8-10.9), while over 12 rows the two 6-row passes were faster (16.3-16.7 against 18.9-19.9).
// Which row counts take it is measured per machine (starjar.cpu.few_rows.settle_stream).
template <int RB, int64_t AHEAD = L2_AHEAD>
__attribute__((target("avx512f"))) void pair512(const float* x, const float* w, const float* b, float* y,
                                                int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t m) {
  __m512 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const float* w0 = w + n0 * K;
  const float* w1 = w + (m == 2 ? n1 : n0) * K;  // m = 1: the first row twice, its second sums dropped
  const int64_t full = K - K % 16;
  for (int64_t k = 0; k < full; k += 16) {
    const __m512 a = _mm512_loadu_ps(w0 + k), c = _mm512_loadu_ps(w1 + k);
    _mm_prefetch(reinterpret_cast<const char*>(w0 + AHEAD + k), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + AHEAD + k), _MM_HINT_T1);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      acc[r][0] = _mm512_fmadd_ps(xv, a, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, c, acc[r][1]);
    }
  }
  if (full < K) {
    const __mmask16 mk = static_cast<__mmask16>((1u << (K - full)) - 1);
    const __m512 a = _mm512_maskz_loadu_ps(mk, w0 + full), c = _mm512_maskz_loadu_ps(mk, w1 + full);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mk, x + r * K + full);
      acc[r][0] = _mm512_fmadd_ps(xv, a, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, c, acc[r][1]);
    }
  }
  const int64_t out[2] = {n0, n1};
  for (int r = 0; r < RB; ++r) {
    for (int j = 0; j < m; ++j) {
      const float s = _mm512_reduce_add_ps(acc[r][j]);
      y[r * N + out[j]] = b != nullptr ? s + b[out[j]] : s;
    }
  }
}

// A tile's outputs for a call over RB (7..12) rows in all, in the tile signature (r0 is 0).
template <int RB>
__attribute__((target("avx512f"))) void wide512(const float* x, const float* w, const float* b, float* y,
                                                int64_t K, int64_t N, int64_t, int64_t n0, int64_t nb) {
  for (int64_t j = 0; j < nb; j += 2) {
    pair512<RB>(x, w, b, y, K, N, n0 + j, n0 + j + 1, std::min<int64_t>(2, nb - j));
  }
}

// Two streams a thread: weight rows [a0, a1) and [c0, c1) (rows, not tiles) against RB (1..6) input rows, row a0 + i
// beside row c0 + i in one pass (pair512), each asked for TWIN_AHEAD floats on, then the longer range's rest one row
// at a time. The hardware prefetcher follows two long runs of rows as well as one, and the thread has twice the
// reads in flight: on a 2-core AMD EPYC (Zen 4), 2 threads, one input row, a 538 MB weight in huge pages read 1.09-
// 1.15x as fast as one run a thread (1.04-1.06x where the runs were only 64 rows long; without the request ahead,
// 0.97-1.03x). Each output's sums are row512's, so which rows share a pass does not change a value. Which row counts
// take it is measured per machine (starjar.cpu.few_rows.settle_stream).
constexpr int64_t TWIN_AHEAD = 512;  // floats: about a weight row of a 576-wide model

template <int RB>
__attribute__((target("avx512f"))) void twin512(const float* x, const float* w, const float* b, float* y,
                                                int64_t K, int64_t N, int64_t a0, int64_t a1, int64_t c0,
                                                int64_t c1) {
  const int64_t both = std::min(a1 - a0, c1 - c0);
  for (int64_t i = 0; i < both; ++i) pair512<RB, TWIN_AHEAD>(x, w, b, y, K, N, a0 + i, c0 + i, 2);
  for (int64_t n = a0 + both; n < a1; ++n) row512<RB>(x, w, b, y, K, N, 0, n);
  for (int64_t n = c0 + both; n < c1; ++n) row512<RB>(x, w, b, y, K, N, 0, n);
}

// A tile's outputs, each weight row against every input row (RB at a time), in the tile signature.
template <int RB>
__attribute__((target("avx2,fma"))) void tile256(const float* x, const float* w, const float* b, float* y,
                                                 int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t nb) {
  for (int64_t j = 0; j < nb; ++j) row256<RB>(x, w, b, y, K, N, r0, n0 + j);
}

template <int RB>
__attribute__((target("avx512f"))) void stream512(const float* x, const float* w, const float* b, float* y,
                                                  int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t nb) {
  for (int64_t j = 0; j < nb; ++j) row512<RB>(x, w, b, y, K, N, r0, n0 + j);
}

using Tile = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                      int64_t);
using Twin = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                      int64_t);

// Tiles for 1..6 input rows at a time: the AVX-512 tile keeps 6 rows x 4 outputs in 24 registers, AVX2's
// 6 rows x 2 lanes of one output in 12. Each tile sums a tile's weight rows against its input rows, each
// weight row against every input row before the next (AVX2, and AVX-512 where stream_mask's bit RB - 1 is
// set) or 4 weight rows interleaved. For AVX2 the streamed form is the only one: a chain of the default
// target's products over 3 input rows took 22 ms so against 25 interleaved (2-core AMD EPYC, Zen 3).
struct Isa {
  Tile tiles[6];      // a call over RB <= max rows in all
  Tile many[6];       // each pass of a call over more rows
  int max;
  Tile wide[6] = {};  // a call over max + 1 .. 2 max rows in one pass, where set
  Twin twin[6] = {};  // a call over RB <= max rows walking two runs of weight rows at once, where set
};

// stream_mask: bit RB - 1 set streams AVX-512's weight rows one at a time for a call over RB input rows (the
// values are the same either way); bit WIDE_SHIFT + RB - 7 takes the wide tiles for a call over RB (7..12) rows;
// bit TWIN_SHIFT + RB - 1, where RB streams, walks two runs of weight rows a thread at once (twin512). A call over
// more rows than a pass takes keeps the interleaved tile: its sums, not the stream, bound it, and the tile loads an input row once for 4 weight rows (on a 2-core AMD EPYC,
// Zen 4, one thread, a 24-token prefill took 123-132 ms streamed against 68-81).
inline Isa isa_of(int64_t which, int64_t stream_mask = 0) {
  if (which == 2) {
    const Tile tiled[6] = {tile512<1>, tile512<2>, tile512<3>, tile512<4>, tile512<5>, tile512<6>};
    const Tile streamed[6] = {stream512<1>, stream512<2>, stream512<3>, stream512<4>, stream512<5>, stream512<6>};
    Isa isa{{}, {}, 6};
    for (int i = 0; i < 6; ++i) {
      isa.tiles[i] = (stream_mask >> i) & 1 ? streamed[i] : tiled[i];
      isa.many[i] = tiled[i];
    }
    const Tile wide[6] = {wide512<7>, wide512<8>, wide512<9>, wide512<10>, wide512<11>, wide512<12>};
    for (int i = 0; i < 6; ++i) isa.wide[i] = (stream_mask >> (WIDE_SHIFT + i)) & 1 ? wide[i] : nullptr;
    const Twin twin[6] = {twin512<1>, twin512<2>, twin512<3>, twin512<4>, twin512<5>, twin512<6>};
    for (int i = 0; i < 6; ++i) {  // a variant of the streamed rows: only where those run
      isa.twin[i] = (stream_mask >> i) & (stream_mask >> (TWIN_SHIFT + i)) & 1 ? twin[i] : nullptr;
    }
    return isa;
  }
  return {{tile256<1>, tile256<2>, tile256<3>, tile256<4>, tile256<5>, tile256<6>},
          {tile256<1>, tile256<2>, tile256<3>, tile256<4>, tile256<5>, tile256<6>}, 6};
}

// The best this CPU has: 2 AVX-512, 1 AVX2 with FMA, 0 neither (no path here).
inline int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

// Tiles [t0, t1) of y = x W^T (+ b) for every input row: x [R, K], W [N, K], y [R, N].
inline void tiles_range(const Isa& kernels, const float* x, const float* w, const float* b, float* y, int64_t R,
                        int64_t K, int64_t N, int64_t t0, int64_t t1) {
  if (R > kernels.max && R <= 2 * kernels.max && kernels.wide[R - kernels.max - 1] != nullptr) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NB;
      kernels.wide[R - kernels.max - 1](x, w, b, y, K, N, 0, n0, std::min<int64_t>(NB, N - n0));
    }
    return;
  }
  const Tile* tiles = R <= kernels.max ? kernels.tiles : kernels.many;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * NB, nb = std::min<int64_t>(NB, N - n0);
    for (int64_t r0 = 0; r0 < R; r0 += kernels.max) {
      const int64_t rb = std::min<int64_t>(kernels.max, R - r0);
      tiles[rb - 1](x, w, b, y, K, N, r0, n0, nb);
    }
  }
}

// Whether a call over R rows walks two runs of weight rows at once (a thread takes from both halves of its share).
inline bool twin_of(const Isa& kernels, int64_t R) {
  return R >= 1 && R <= kernels.max && kernels.twin[R - 1] != nullptr;
}

// Tiles [a0, a1) and [c0, c1) of y = x W^T (+ b): in one walk where the call's row count walks two runs of weight
// rows at once (twin512), else one range after the other.
inline void tiles_two(const Isa& kernels, const float* x, const float* w, const float* b, float* y, int64_t R,
                      int64_t K, int64_t N, int64_t a0, int64_t a1, int64_t c0, int64_t c1) {
  if (twin_of(kernels, R) && a0 < a1 && c0 < c1) {
    kernels.twin[R - 1](x, w, b, y, K, N, a0 * NB, std::min(a1 * NB, N), c0 * NB, std::min(c1 * NB, N));
    return;
  }
  if (a0 < a1) tiles_range(kernels, x, w, b, y, R, K, N, a0, a1);
  if (c0 < c1) tiles_range(kernels, x, w, b, y, R, K, N, c0, c1);
}

// Half of a thread's share of one product's tiles, [lo, hi) packed in one word (lo in the low half): its owner takes
// tiles from the front, a thread done with its own share takes them from the back. Which thread sums a tile does
// not change its values. On a 2-core AMD EPYC (Zen 4), 2 threads, against each thread held to its own share, no
// taking from the other (every variant in turn in one process): a default-target pass over 4 rows ran 9% faster, over 8 rows 9%, over 16 rows
// 5%; one row, which the shared memory bandwidth bounds, the same within 1%. An owner taking 4 tiles at a time
// instead of 16 made one row 2.5% slower (its stream broken up, the gate and up halves alternating).
struct alignas(64) Share {
  std::atomic<uint64_t> span;
};
constexpr int64_t OWN_TILES = 16;    // tiles an owner takes at a time: 64 weight rows
constexpr int64_t STOLEN_TILES = 2;  // tiles taken from another thread's back

inline uint64_t pack(int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) | static_cast<uint64_t>(hi) << 32; }

// A thread's share [lo, hi) set into its two halves, own[0] and own[1].
inline void share_out(Share* own, int64_t lo, int64_t hi) {
  const int64_t mid = lo + (hi - lo) / 2;
  own[0].span.store(pack(lo, mid), std::memory_order_relaxed);
  own[1].span.store(pack(mid, hi), std::memory_order_relaxed);
}

// Up to `count` tiles [*t0, *t1) off the front (or the back) of a half; false when it is empty.
inline bool grab(Share& half, int64_t count, bool front, int64_t* t0, int64_t* t1) {
  for (;;) {
    uint64_t old = half.span.load(std::memory_order_relaxed);
    const int64_t lo = static_cast<int64_t>(old & 0xFFFFFFFFu), hi = static_cast<int64_t>(old >> 32);
    if (lo >= hi) return false;
    *t0 = front ? lo : std::max(lo, hi - count);
    *t1 = front ? std::min(lo + count, hi) : hi;
    if (half.span.compare_exchange_weak(old, front ? pack(*t1, hi) : pack(lo, *t0), std::memory_order_relaxed)) {
      return true;
    }
  }
}

// Every tile of shares [0, 2 n) (two halves a thread) taken by thread tid in turn: its own halves first, one after
// the other or, where `twin`, from both fronts at once; then the other threads' backs, until none is left.
// take(a0, a1, c0, c1) sums tiles [a0, a1) and [c0, c1) (either may be empty). Each tile is taken once, however the
// threads run.
template <typename Take>
void take_tiles(Share* shares, int tid, int n, bool twin, Take take) {
  Share* own = shares + 2 * tid;
  int64_t a0, a1, c0, c1;
  if (twin) {
    for (;;) {
      const bool a = grab(own[0], OWN_TILES, true, &a0, &a1), c = grab(own[1], OWN_TILES, true, &c0, &c1);
      if (!a && !c) break;
      take(a ? a0 : 0, a ? a1 : 0, c ? c0 : 0, c ? c1 : 0);
    }
  } else {
    for (int h = 0; h < 2; ++h) {
      while (grab(own[h], OWN_TILES, true, &a0, &a1)) take(a0, a1, 0, 0);
    }
  }
  for (int step = 1; step < n; ++step) {
    Share* other = shares + 2 * ((tid + step) % n);
    for (int h = 1; h >= 0; --h) {
      while (grab(other[h], STOLEN_TILES, false, &a0, &a1)) take(a0, a1, 0, 0);
    }
  }
}

}  // namespace starjar_tiles
