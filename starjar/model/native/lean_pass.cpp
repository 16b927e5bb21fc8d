// A float32 Llama-family target's chain pass written whole: every layer over B rows x Q tokens on consecutive
// cache slots, in one parallel region, with starjar's own products (the few-row tiles), RMSNorm, rotation,
// attention and SiLU.
//
// The native pass (target_pass.cpp) keeps HF's bits by calling ATen for every sum. On a 2-core Xeon (AVX512) a
// default-target step took 25-30 ms where its 121 products alone took 19-25: the rest was ATen's dispatch,
// allocation and the flash kernel's set-up for a query of one token, 150 times a token. Here only the products'
// streaming is left: the threads stay in one OpenMP region for the whole pass, split each product's weight tiles
// (and the attention heads, and SiLU's elements) between them, and meet at a barrier between phases. The sums
// are ordered our own way (the tiles' lanes, attention's softmax in one sweep over the keys), so values differ
// from HF's by rounding: starjar.model.lean_target takes this pass where it measured faster, and the tests hold
// its greedy output to HF generate()'s (tests/starjar/test_lean_pass.py). Each row's values do not depend on the
// other rows of the pass or on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include "../../cpu/native/int8_tiles.h"
#include "../../cpu/native/tiles.h"
#include "lean_avx2.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace {

using starjar_tiles::Isa;
using starjar_tiles::NB;
using starjar_tiles::Share;
using starjar_tiles::take_tiles;

static_assert(starjar_tiles::NB == starjar_int8::NB, "the float and int8 tiles hold as many weight rows");

constexpr int64_t MAX_D = 512;  // the largest head dimension taken (a rotated head sits on the stack)

// Attention's two vector steps over a head of d floats: q . k, and y += a v.
__attribute__((target("avx512f"))) float dot512(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  int64_t e = 0;
  for (; e + 16 <= d; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), _mm512_loadu_ps(b + e), acc);
  if (e < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - e)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + e), _mm512_maskz_loadu_ps(m, b + e), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f"))) void axpy512(float* y, float a, const float* v, int64_t d) {
  const __m512 av = _mm512_set1_ps(a);
  int64_t e = 0;
  for (; e + 16 <= d; e += 16) _mm512_storeu_ps(y + e, _mm512_fmadd_ps(av, _mm512_loadu_ps(v + e), _mm512_loadu_ps(y + e)));
  if (e < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - e)) - 1);
    _mm512_mask_storeu_ps(y + e, m, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, v + e), _mm512_maskz_loadu_ps(m, y + e)));
  }
}

__attribute__((target("avx2,fma"))) float dot256(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 8 <= d; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), acc);
  float s = starjar_tiles::reduce256(acc);
  for (; e < d; ++e) s += a[e] * b[e];
  return s;
}

__attribute__((target("avx2,fma"))) void axpy256(float* y, float a, const float* v, int64_t d) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t e = 0;
  for (; e + 8 <= d; e += 8) _mm256_storeu_ps(y + e, _mm256_fmadd_ps(av, _mm256_loadu_ps(v + e), _mm256_loadu_ps(y + e)));
  for (; e < d; ++e) y[e] += a * v[e];
}

// e^x in 16 lanes: x = n ln2 + r (|r| <= ln2 / 2), e^r by its Taylor polynomial of degree 7 (the remainder
// under 1e-8 relative), scaled by 2^n; lanes below -87 (hidden keys, SiLU's far tail) give 0.
__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts: r exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 poly = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
  }
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(poly, n));
}

// Up to G query heads of one KV head with AVX-512 over a head of 16 C floats: each key and value row loaded
// once for all G heads, whose sums run side by side. Each head's sums are those of a head alone, in the same
// order: its scores (q . k scaling + mask; hidden keys -inf), their exponentials 16 at a time, then p v summed;
// out = that / sum. So a head's values do not depend on which heads share its sweep. GQA's heads share their
// keys (the default target: 3 a KV head); on a 2-core AMD EPYC (Zen 4), decoding after 281 tokens, attention
// took 4-6% of the pass one head at a time and about a tenth less so.
constexpr int GROUP_MAX = 4;  // heads a sweep takes: C = 4 keeps 4 x 4 sums in registers

template <int C, int G>
__attribute__((target("avx512f"))) void attend_group512(const float* q, const float* keys, int64_t kstride,
                                                        const float* vals, int64_t vstride, const float* m,
                                                        int64_t mstride, int64_t n, float scaling, float* sc,
                                                        float* const* out) {
  const float hidden = std::numeric_limits<float>::lowest() / 2, none = -std::numeric_limits<float>::infinity();
  float top[G];
  for (int h = 0; h < G; ++h) top[h] = none;
  for (int64_t s = 0; s < n; ++s) {
    const float add = m != nullptr ? m[s * mstride] : 0.0f;
    if (add <= hidden) {
      for (int h = 0; h < G; ++h) sc[h * n + s] = none;
      continue;
    }
    const float* kr = keys + s * kstride;
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(kr + 16 * c);
    for (int h = 0; h < G; ++h) {
      const float* qh = q + h * 16 * C;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kv[c], acc);
      sc[h * n + s] = _mm512_reduce_add_ps(acc) * scaling + add;
      top[h] = std::max(top[h], sc[h * n + s]);
    }
  }
  float inv[G];
  for (int h = 0; h < G; ++h) {
    inv[h] = 0.0f;
    if (top[h] == none) continue;  // no key visible: the head's output is zero
    const __m512 tv = _mm512_set1_ps(top[h]);
    __m512 sum = _mm512_setzero_ps();
    float* sh = sc + h * n;
    for (int64_t s = 0; s < n; s += 16) {
      const __mmask16 in = n - s >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - s)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(in, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, sh + s), tv)));
      _mm512_mask_storeu_ps(sh + s, in, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[h] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  __m512 ov[G][C];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) ov[h][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    const float* vr = vals + s * vstride;
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
    for (int h = 0; h < G; ++h) {
      const float e = top[h] == none ? 0.0f : sc[h * n + s];
      if (e == 0.0f) continue;
      const __m512 pv = _mm512_set1_ps(e);
      for (int c = 0; c < C; ++c) ov[h][c] = _mm512_fmadd_ps(pv, vv[c], ov[h][c]);
    }
  }
  for (int h = 0; h < G; ++h) {
    const __m512 iv = _mm512_set1_ps(inv[h]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[h] + 16 * c, _mm512_mul_ps(ov[h][c], iv));
  }
}

// The sweep for g heads (1..GROUP_MAX) of a head of 16 C floats.
template <int C>
void attend_heads512(int g, const float* q, const float* keys, int64_t kstride, const float* vals, int64_t vstride,
                     const float* m, int64_t mstride, int64_t n, float scaling, float* sc, float* const* out) {
  using Sweep = void (*)(const float*, const float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                         float, float*, float* const*);
  static constexpr Sweep sweeps[GROUP_MAX] = {attend_group512<C, 1>, attend_group512<C, 2>, attend_group512<C, 3>,
                                              attend_group512<C, 4>};
  sweeps[g - 1](q, keys, kstride, vals, vstride, m, mstride, n, scaling, sc, out);
}

// silu(g) * u over n elements with AVX-512, the last ones under a mask: every element's value the same wherever
// a range of them starts or ends (threads take SiLU's elements in ranges of any length).
__attribute__((target("avx512f"))) void silu_mul512(const float* g, const float* u, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t e = 0; e < n; e += 16) {
    const __mmask16 in = n - e >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - e)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(in, g + e);
    const __m512 den = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    _mm512_mask_storeu_ps(out + e, in, _mm512_mul_ps(_mm512_div_ps(x, den), _mm512_maskz_loadu_ps(in, u + e)));
  }
}

struct Kernels {
  int64_t isa;
  bool vnni;  // int8 products on VNNI's tiles (AVX-512 asked for and present), else AVX2's
  Isa tiles;
  int64_t int8_stream;  // bit RB - 1: VNNI's weight rows streamed for RB input rows; bit 6 + RB - 1: twinned
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float*, float, const float*, int64_t);
};

// Which AVX-512 row counts stream their weight rows one at a time (lean_pass_stream sets it): bits 0-5 the float
// products' (tiles.h's isa_of), bits 6-11 the int8 products' (int8_tiles.h's int8_range), bits 12-17 the float
// row counts 7..12 that take the wide tiles (tiles.h's wide512), bits 18-23 the streamed float row counts that walk
// two runs of weight rows at once (tiles.h's twin512), bits 24-29 the streamed int8 ones that do (int8_tiles.h's
// twin_rows).
std::atomic<int64_t> stream_mask{0};

Kernels kernels_of(int64_t isa) {
  const int64_t mask = stream_mask.load();
  if (isa == 2) {
    return {2, starjar_int8::has_vnni(), starjar_tiles::isa_of(2, mask), starjar_tiles::int8_bits(mask), dot512,
            axpy512};
  }
  return {1, false, starjar_tiles::isa_of(1), 0, dot256, axpy256};
}

// One product's weights: float32 W [N, K], or the own int8 layout (W [N, Kp] int8, meta [2, N]: each output's
// scale and weight sum; starjar.cpu.few_rows.int8_layout); and its bias.
struct Weight {
  const float* w;
  const int8_t* q;
  const float* meta;
  int64_t kp;
  const float* b;
};

// One layer's norms and products (fused q/k/v and gate/up, as target_pass.cpp and draft_pass.cpp take them:
// qkv, o, gate-up, down) and its K/V buffers [B, nk, L, d].
struct Layer {
  const float *norm1, *norm2;
  Weight wt[4];
  int64_t nq, nk, inner;
  float *kp, *vp;
  int64_t ks[4], vs[4];
};

// What every phase of the pass reads: sizes, positions and the scratch the threads share.
struct Pass {
  int64_t B, Q, H, R, d, start, kv_len;
  float eps, scaling;
  const float *cos, *sin_signed;  // [R, d]: each token's position, rotate_half's sign folded into sin
  const int64_t* write;           // [R]: each token's cache position, or null: one span from `start`
  const float* mask;              // additive [B, 1, Q, >= kv_len] (strides mask_s), or null: every key visible
  int64_t mask_s[4];
  float *heads, *att, *y, *gu, *act;  // [R, nq + 2 nk, d], [R, nq d], [R, H], [R, 2 inner], [R, inner]
  float *h, *scores, *qrot;           // per thread: [R, H], [GROUP_MAX, kv_len], [GROUP_MAX, d]
  uint8_t* xq;                        // per thread, int8 products: the input rows quantized [R, kq]
  float* xscale;                      // per thread: each row's scale and zero point [2 R]
  int64_t kq;
  Share* shares;                      // [layers, 4 products, threads, 2 halves]: each product's tiles split
};

inline void split(int64_t total, int tid, int n, int64_t* lo, int64_t* hi) {
  *lo = total * tid / n;
  *hi = total * (tid + 1) / n;
}

// LlamaRMSNorm of R rows of x into out (each thread its own copy: no barrier before the product reading it).
void rms_norm(const float* x, const float* w, float* out, int64_t R, int64_t H, float eps) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * H;
    double sum = 0;
    for (int64_t i = 0; i < H; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum / H) + eps);
    for (int64_t i = 0; i < H; ++i) out[r * H + i] = w[i] * (xr[i] * inv);
  }
}

// x's rows quantized for an int8 product, into this thread's own copy (no barrier); nothing for a float one.
void quantize_rows(const Kernels& k, const Pass& p, const Weight& wt, const float* x, int64_t R, int64_t K, int tid) {
  if (wt.q == nullptr) return;
  uint8_t* xq = p.xq + tid * p.R * p.kq;
  float* sx = p.xscale + tid * 2 * p.R;
  for (int64_t r = 0; r < R; ++r) {
    const auto [scale, zero] = starjar_int8::quantize(x + r * K, K, wt.kp, xq + r * wt.kp, k.vnni);
    sx[r] = scale, sx[R + r] = static_cast<float>(zero);
  }
}

// Tiles [a0, a1) and [c0, c1) of y = x W^T (+ b) (x already quantized where the product is int8), and where
// `residual` is given y += residual there.
void tiles(const Kernels& k, const Pass& p, const Weight& wt, const float* x, float* y, int64_t R, int64_t K,
           int64_t N, int tid, int64_t a0, int64_t a1, int64_t c0, int64_t c1, const float* residual) {
  if (wt.q != nullptr) {
    float* sx = p.xscale + tid * 2 * p.R;
    const starjar_int8::Job job{p.xq + tid * p.R * p.kq, sx, sx + R, wt.q, wt.meta, wt.meta + N, wt.b, y, wt.kp, N};
    starjar_int8::int8_two(job, R, a0, a1, c0, c1, k.vnni, k.int8_stream);
  } else {
    starjar_tiles::tiles_two(k.tiles, x, wt.w, wt.b, y, R, K, N, a0, a1, c0, c1);
  }
  if (residual == nullptr) return;
  for (const auto [t0, t1] : {std::pair{a0, a1}, std::pair{c0, c1}}) {
    const int64_t n0 = t0 * NB, n1 = std::min<int64_t>(t1 * NB, N);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = n0; i < n1; ++i) y[r * N + i] = residual[r * N + i] + y[r * N + i];
  }
}

// Product j of layer l: its tiles shared between the threads (Share).
void product(const Kernels& k, const Pass& p, int64_t l, int j, const Weight& wt, const float* x, float* y, int64_t R,
             int64_t K, int64_t N, int tid, int n, const float* residual) {
  quantize_rows(k, p, wt, x, R, K, tid);
  const bool twin = wt.q == nullptr ? starjar_tiles::twin_of(k.tiles, R) : starjar_int8::twins(R, k.vnni,
                                                                                               k.int8_stream);
  take_tiles(p.shares + (l * 4 + j) * 2 * n, tid, n, twin, [&](int64_t a0, int64_t a1, int64_t c0, int64_t c1) {
    tiles(k, p, wt, x, y, R, K, N, tid, a0, a1, c0, c1, residual);
  });
}

// q or k of token r rotated: src [d] -> dst [d].
inline void rotate(const Pass& p, int64_t r, const float* src, float* dst) {
  const float* c = p.cos + r * p.d;
  const float* s = p.sin_signed + r * p.d;
  const int64_t half = p.d / 2;
  for (int64_t e = 0; e < p.d; ++e) dst[e] = src[e] * c[e] + src[e < half ? e + half : e - half] * s[e];
}

// Every token's K (rotated) and V written into the rows' buffers: items (token, kv head) split between threads.
void write_kv(const Pass& p, const Layer& L, int tid, int n) {
  const int64_t heads_n = L.nq + 2 * L.nk;
  int64_t i0, i1;
  split(p.R * L.nk, tid, n, &i0, &i1);
  float rotated[MAX_D];
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t r = i / L.nk, j = i % L.nk, b = r / p.Q, t = r % p.Q;
    const int64_t pos = p.write != nullptr ? p.write[r] : p.start + t;
    const float* src = p.heads + (r * heads_n + L.nq + j) * p.d;
    rotate(p, r, src, rotated);
    float* kd = L.kp + b * L.ks[0] + j * L.ks[1] + pos * L.ks[2];
    float* vd = L.vp + b * L.vs[0] + j * L.vs[1] + pos * L.vs[2];
    const float* vr = src + L.nk * p.d;
    for (int64_t e = 0; e < p.d; ++e) {
      kd[e * L.ks[3]] = rotated[e];
      vd[e * L.vs[3]] = vr[e];
    }
  }
}

// Attention of every (token, query head): softmax(q k^T scaling + mask) v over kv_len keys, in one sweep. The
// (token, head) items are split between threads as before; with AVX-512 a thread sweeps the keys once for each
// run of its heads that share a KV head (attend_group512: the same values as one head at a time).
void attend(const Kernels& k, const Pass& p, const Layer& L, int tid, int n) {
  const int64_t heads_n = L.nq + 2 * L.nk, g = L.nq / L.nk, d = p.d;
  float* sc = p.scores + tid * GROUP_MAX * p.kv_len;
  float* q = p.qrot + tid * GROUP_MAX * d;
  const float hidden = std::numeric_limits<float>::lowest() / 2;  // a mask this low hides the key
  int64_t i0, i1;
  split(p.R * L.nq, tid, n, &i0, &i1);
  for (int64_t i = i0; i < i1;) {
    const int64_t r = i / L.nq, hq = i % L.nq, b = r / p.Q, t = r % p.Q, j = hq / g;
    const float* keys = L.kp + b * L.ks[0] + j * L.ks[1];
    const float* vals = L.vp + b * L.vs[0] + j * L.vs[1];
    const float* m = p.mask != nullptr ? p.mask + b * p.mask_s[0] + t * p.mask_s[2] : nullptr;
    float* out = p.att + r * L.nq * d + hq * d;
    if (k.isa == 2 && (d == 64 || d == 128)) {  // the heads Llama-family models have, in registers
      const int run = static_cast<int>(std::min<int64_t>({i1 - i, (j + 1) * g - hq, d == 64 ? GROUP_MAX : 2}));
      float* outs[GROUP_MAX];
      for (int h = 0; h < run; ++h) {
        rotate(p, r, p.heads + (r * heads_n + hq + h) * d, q + h * d);
        outs[h] = out + h * d;
      }
      (d == 64 ? attend_heads512<4> : attend_heads512<8>)(run, q, keys, L.ks[2], vals, L.vs[2], m, p.mask_s[3],
                                                          p.kv_len, p.scaling, sc, outs);
      i += run;
      continue;
    }
    ++i;
    rotate(p, r, p.heads + (r * heads_n + hq) * d, q);
    if (k.isa == 1 && (d == 64 || d == 128)) {
      (d == 64 ? starjar_lean_avx2::attend_head256<8> : starjar_lean_avx2::attend_head256<16>)(
          q, keys, L.ks[2], vals, L.vs[2], m, p.mask_s[3], p.kv_len, p.scaling, sc, out);
      continue;
    }
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < p.kv_len; ++s) {
      const float add = m != nullptr ? m[s * p.mask_s[3]] : 0.0f;
      sc[s] = add <= hidden ? -std::numeric_limits<float>::infinity()
                            : k.dot(q, keys + s * L.ks[2], d) * p.scaling + add;
      top = std::max(top, sc[s]);
    }
    std::fill(out, out + d, 0.0f);
    if (top == -std::numeric_limits<float>::infinity()) continue;  // no key visible
    float total = 0;
    for (int64_t s = 0; s < p.kv_len; ++s) {
      const float e = sc[s] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(sc[s] - top);
      total += e;
      if (e != 0.0f) k.axpy(out, e, vals + s * L.vs[2], d);
    }
    const float inv = 1.0f / total;
    for (int64_t e = 0; e < d; ++e) out[e] *= inv;
  }
}

// silu(gate) * up for this thread's share of the elements.
void gated(const Kernels& k, const Pass& p, const Layer& L, int tid, int n) {
  int64_t i0, i1;
  split(p.R * L.inner, tid, n, &i0, &i1);
  for (int64_t i = i0; i < i1;) {  // row by row, each row's share in one run
    const int64_t r = i / L.inner, e = i % L.inner, len = std::min(i1 - i, L.inner - e);
    const float* g = p.gu + r * 2 * L.inner + e;
    (k.isa == 2 ? silu_mul512 : starjar_lean_avx2::silu_mul256)(g, g + L.inner, p.act + i, len);
    i += len;
  }
}

// The gate-up product and SiLU without a barrier between: where the gate's outputs fill whole tiles, a thread
// takes the same tiles of the gate and of the up half (two runs of weight rows, walked at once where the row count
// twins), then gates those elements itself.
void gate_up(const Kernels& k, const Pass& p, int64_t l, const Layer& L, const float* h, int tid, int n) {
  const int64_t N = 2 * L.inner, half = L.inner / NB;
  if (L.inner % NB != 0) {
    product(k, p, l, 2, L.wt[2], h, p.gu, p.R, p.H, N, tid, n, nullptr);
#pragma omp barrier
    gated(k, p, L, tid, n);
    return;
  }
  quantize_rows(k, p, L.wt[2], h, p.R, p.H, tid);
  take_tiles(p.shares + (l * 4 + 2) * 2 * n, tid, n, false, [&](int64_t t0, int64_t t1, int64_t, int64_t) {
    tiles(k, p, L.wt[2], h, p.gu, p.R, p.H, N, tid, t0, t1, half + t0, half + t1, nullptr);
    const int64_t e0 = t0 * NB, len = (t1 - t0) * NB;
    for (int64_t r = 0; r < p.R; ++r) {
      const float* g = p.gu + r * N + e0;
      (k.isa == 2 ? silu_mul512 : starjar_lean_avx2::silu_mul256)(g, g + L.inner, p.act + r * L.inner + e0, len);
    }
  });
}

// One layer, by one thread of the region: x [R, H] in, out [R, H] written.
void layer(const Kernels& k, const Pass& p, int64_t l, const Layer& L, const float* x, float* out, int tid, int n) {
  float* h = p.h + tid * p.R * p.H;
  const int64_t heads_n = L.nq + 2 * L.nk;
  rms_norm(x, L.norm1, h, p.R, p.H, p.eps);
  product(k, p, l, 0, L.wt[0], h, p.heads, p.R, p.H, heads_n * p.d, tid, n, nullptr);
#pragma omp barrier
  write_kv(p, L, tid, n);
#pragma omp barrier
  attend(k, p, L, tid, n);
#pragma omp barrier
  product(k, p, l, 1, L.wt[1], p.att, p.y, p.R, L.nq * p.d, p.H, tid, n, x);
#pragma omp barrier
  rms_norm(p.y, L.norm2, h, p.R, p.H, p.eps);
  gate_up(k, p, l, L, h, tid, n);
#pragma omp barrier
  product(k, p, l, 3, L.wt[3], p.act, out, p.R, L.inner, p.H, tid, n, p.y);
#pragma omp barrier
}

using Tensors = c10::List<at::Tensor>;

// The product `j` of a layer (0 qkv, 1 o, 2 gate-up, 3 down) checked against its shape [N, K]: float32 from ws,
// or int8 with its meta where q8 is given.
Weight weight_of(const at::Tensor* w, const at::Tensor* q8, const at::Tensor* meta,
                 const std::optional<at::Tensor>& b, int64_t N, int64_t K) {
  TORCH_CHECK(!b.has_value() || !b->defined() || (b->scalar_type() == at::kFloat && b->is_contiguous() &&
              b->numel() == N), "lean_pass: contiguous float32 biases, one an output");
  const float* bias = b.has_value() && b->defined() ? b->data_ptr<float>() : nullptr;
  if (q8 == nullptr) {
    TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->dim() == 2 && w->size(0) == N &&
                w->size(1) == K, "lean_pass: contiguous float32 weights [N, K] matching the hidden size and heads");
    return {w->data_ptr<float>(), nullptr, nullptr, 0, bias};
  }
  TORCH_CHECK(q8->scalar_type() == at::kChar && q8->is_contiguous() && q8->dim() == 2 && q8->size(0) == N &&
              q8->size(1) % starjar_int8::KB == 0 && q8->size(1) >= K && q8->size(1) < K + starjar_int8::KB,
              "lean_pass: int8 weights [N, K padded to a multiple of 64] matching the hidden size and heads");
  TORCH_CHECK(meta->scalar_type() == at::kFloat && meta->is_contiguous() && meta->dim() == 2 && meta->size(0) == 2 &&
              meta->size(1) == N, "lean_pass: int8 meta [2, N]");
  return {nullptr, q8->data_ptr<int8_t>(), meta->data_ptr<float>(), q8->size(1), bias};
}

// Each layer's norms, products and K/V buffers: ws six a layer (input norm, qkv, o, post norm, gate-up, down),
// or, with int8 weights (q8 and meta four a layer), its two norms only.
std::vector<Layer> layers_of(const Tensors& ws, const c10::List<std::optional<at::Tensor>>& bs, const Tensors* q8,
                             const Tensors* meta, const Tensors& keys, const Tensors& values, at::IntArrayRef nq,
                             at::IntArrayRef nk, int64_t B, int64_t H, int64_t d) {
  const int64_t n = static_cast<int64_t>(nq.size()), per = q8 != nullptr ? 2 : 6;
  TORCH_CHECK(ws.size() == per * n && bs.size() == 4 * n && keys.size() == n && values.size() == n &&
              (q8 == nullptr || (q8->size() == 4 * n && meta->size() == 4 * n)),
              "lean_pass: six weights (two norms with int8 products) and four biases a layer, and each layer's K and V");
  std::vector<Layer> out;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor &kt = keys.get(i), &vt = values.get(i), &n1 = ws.get(i * per), &n2 = ws.get(i * per + per / 2);
    TORCH_CHECK(nk[i] > 0 && nq[i] % nk[i] == 0, "lean_pass: query heads a multiple of the KV heads");
    TORCH_CHECK(kt.scalar_type() == at::kFloat && vt.scalar_type() == at::kFloat && kt.dim() == 4 && vt.dim() == 4 &&
                kt.size(0) == B && vt.size(0) == B && kt.size(1) == nk[i] && vt.size(1) == nk[i] &&
                kt.size(3) == d && vt.size(3) == d && kt.stride(3) == 1 && vt.stride(3) == 1,
                "lean_pass: float32 K/V buffers [B, nk, L, d], dense in d");
    TORCH_CHECK(n1.scalar_type() == at::kFloat && n2.scalar_type() == at::kFloat && n1.is_contiguous() &&
                n2.is_contiguous() && n1.numel() == H && n2.numel() == H, "lean_pass: float32 norm weights [H]");
    const int64_t inner = (q8 != nullptr ? q8->get(i * 4 + 2) : ws.get(i * 6 + 4)).size(0) / 2;
    const int64_t shape[4][2] = {{(nq[i] + 2 * nk[i]) * d, H}, {H, nq[i] * d}, {2 * inner, H}, {H, inner}};
    Layer L{n1.data_ptr<float>(), n2.data_ptr<float>(), {}, nq[i], nk[i], inner, kt.data_ptr<float>(),
            vt.data_ptr<float>(), {}, {}};
    for (int j = 0; j < 4; ++j) {
      const int64_t at_ws[4] = {1, 2, 4, 5};
      const at::Tensor w = q8 != nullptr ? at::Tensor() : ws.get(i * 6 + at_ws[j]);
      const at::Tensor qw = q8 != nullptr ? q8->get(i * 4 + j) : at::Tensor();
      const at::Tensor mw = q8 != nullptr ? meta->get(i * 4 + j) : at::Tensor();
      L.wt[j] = weight_of(&w, q8 != nullptr ? &qw : nullptr, &mw, bs.get(i * 4 + j), shape[j][0], shape[j][1]);
    }
    for (int a = 0; a < 4; ++a) {
      L.ks[a] = kt.stride(a);
      L.vs[a] = vt.stride(a);
    }
    out.push_back(L);
  }
  return out;
}

// Where each token's K and V go: write [B, Q] (checked inside every layer's buffers), or one span from `start`.
at::Tensor positions(const std::optional<at::Tensor>& write, int64_t start, int64_t Q, int64_t R,
                     const Tensors& keys, const Tensors& values) {
  at::Tensor at_pos;
  if (write.has_value() && write->defined()) {
    at_pos = write->to(at::kLong).contiguous();
    TORCH_CHECK(at_pos.numel() == R, "lean_pass: write must hold each token's cache position");
  }
  const int64_t* wp = at_pos.defined() ? at_pos.data_ptr<int64_t>() : nullptr;
  for (int64_t l = 0; l < static_cast<int64_t>(keys.size()); ++l) {
    const int64_t room = std::min(keys.get(l).size(2), values.get(l).size(2));
    for (int64_t i = 0; wp != nullptr && i < R; ++i) {
      TORCH_CHECK(wp[i] >= 0 && wp[i] < room, "lean_pass: a write position lies outside the KV buffers");
    }
    TORCH_CHECK(wp != nullptr || (start >= 0 && start + Q <= room),
                "lean_pass: the written span lies outside the KV buffers");
  }
  return at_pos;
}

// Every layer of a pass: x [B, Q, H]; ws six weights a layer (input norm, qkv, o, post norm, gate-up, down),
// or two (the norms) where q8 and meta give the products in the own int8 layout (four a layer: qkv, o,
// gate-up, down; AVX-512 VNNI, or AVX2); bs four biases a layer; cos and sin_signed each token's [d]; mask additive
// [B, 1, Q, >= kv_len] or None (every key visible); keys and values the rows' buffers, written as one span
// from `start` or each token at write [B, Q]; isa 0 the best this CPU has, 1 AVX2, 2 AVX-512. Returns the
// hidden states after the last layer [B, Q, H], through the model's final RMSNorm where its weight `norm` is given.
at::Tensor lean_pass(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                     const std::optional<at::Tensor>& mask, const c10::List<at::Tensor>& ws,
                     const c10::List<std::optional<at::Tensor>>& bs, const c10::List<at::Tensor>& keys,
                     const c10::List<at::Tensor>& values, int64_t start, int64_t kv_len, at::IntArrayRef nq,
                     at::IntArrayRef nk, int64_t d, double eps, double scaling, const std::optional<at::Tensor>& write,
                     int64_t isa, const std::optional<Tensors>& q8, const std::optional<Tensors>& meta,
                     const std::optional<at::Tensor>& norm) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3, "lean_pass takes float32 [B, Q, H]");
  const int64_t best = starjar_tiles::best_isa(), which = isa == 0 ? best : isa;
  TORCH_CHECK(which >= 1 && which <= best, "lean_pass: this CPU lacks the instructions asked for (", isa, ")");
  const int64_t B = x.size(0), Q = x.size(1), H = x.size(2), R = B * Q;
  const bool int8 = q8.has_value();
  TORCH_CHECK(!int8 || meta.has_value(), "lean_pass: int8 products need their meta");
  const std::vector<Layer> lw = layers_of(ws, bs, int8 ? &*q8 : nullptr, int8 ? &*meta : nullptr, keys, values, nq,
                                          nk, B, H, d);
  const at::Tensor c = cos.contiguous(), s = sin_signed.contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat && c.numel() == R * d &&
              s.numel() == R * d, "lean_pass: cos and sin must hold each token's position");
  int64_t width = 0, inner = 0, att_w = 0, kq = 0;
  TORCH_CHECK(d > 0 && d <= MAX_D && d % 2 == 0, "lean_pass: an even head dimension up to ", MAX_D);
  for (int64_t l = 0; l < static_cast<int64_t>(lw.size()); ++l) {
    const Layer& L = lw[l];
    TORCH_CHECK(kv_len >= 0 && kv_len <= keys.get(l).size(2) && kv_len <= values.get(l).size(2),
                "lean_pass: kv_len past the KV buffers");
    width = std::max(width, (L.nq + 2 * L.nk) * d);
    inner = std::max(inner, L.inner);
    att_w = std::max(att_w, L.nq * d);
    for (const Weight& w : L.wt) kq = std::max(kq, w.kp);
  }
  const at::Tensor at_pos = positions(write, start, Q, R, keys, values);
  const bool masked = mask.has_value() && mask->defined();
  if (masked) {
    TORCH_CHECK(mask->scalar_type() == at::kFloat && mask->dim() == 4 && mask->size(0) == B && mask->size(2) == Q &&
                mask->size(3) >= kv_len, "lean_pass: an additive float32 mask [B, 1, Q, >= kv_len]");
  }
  const int nt = std::max(1, at::get_num_threads());
  const auto opts = x.options();
  at::Tensor scratch = at::empty({R * (width + att_w + H + 3 * inner) + nt * (R * H + GROUP_MAX * (kv_len + d))}, opts);
  float* sp = scratch.data_ptr<float>();
  Pass p{B, Q, H, R, d, start, kv_len, static_cast<float>(eps), static_cast<float>(scaling), c.data_ptr<float>(),
         s.data_ptr<float>(), at_pos.defined() ? at_pos.data_ptr<int64_t>() : nullptr,
         masked ? mask->data_ptr<float>() : nullptr, {}, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
         nullptr, nullptr, nullptr, nullptr, 0};
  if (masked) {
    for (int a = 0; a < 4; ++a) p.mask_s[a] = mask->stride(a);
  }
  p.heads = sp;
  p.att = p.heads + R * width;
  p.y = p.att + R * att_w;
  p.gu = p.y + R * H;
  p.act = p.gu + R * 2 * inner;
  p.h = p.act + R * inner;
  p.scores = p.h + nt * R * H;
  p.qrot = p.scores + nt * GROUP_MAX * kv_len;
  at::Tensor quantized = at::empty({int8 ? nt * R * kq : 0}, opts.dtype(at::kByte));
  at::Tensor row_scales = at::empty({int8 ? nt * 2 * R : 0}, opts);
  p.xq = quantized.data_ptr<uint8_t>();
  p.xscale = row_scales.data_ptr<float>();
  p.kq = kq;
  const bool normed = norm.has_value() && norm->defined();
  TORCH_CHECK(!normed || (norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == H),
              "lean_pass: a float32 final norm weight [H]");
  at::Tensor bufs[2] = {at::empty_like(x), at::empty_like(x)};
  const Kernels k = kernels_of(which);
  const int64_t layers = static_cast<int64_t>(lw.size());
  const std::unique_ptr<Share[]> shares(new Share[std::max<int64_t>(1, layers * 4 * nt * 2)]);
  p.shares = shares.get();
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
#pragma omp single
    for (int64_t i = 0; i < layers; ++i) {  // each product's tiles split evenly, for the threads this region has
      const Layer& L = lw[i];
      const int64_t gu = L.inner % NB == 0 ? L.inner / NB : (2 * L.inner + NB - 1) / NB;
      const int64_t tiles_of[4] = {((L.nq + 2 * L.nk) * d + NB - 1) / NB, (H + NB - 1) / NB, gu, (H + NB - 1) / NB};
      for (int j = 0; j < 4; ++j) {
        for (int t = 0; t < n; ++t) {
          int64_t lo, hi;
          split(tiles_of[j], t, n, &lo, &hi);
          starjar_tiles::share_out(p.shares + ((i * 4 + j) * n + t) * 2, lo, hi);
        }
      }
    }  // the single's barrier: every share set before any is taken
    const float* cur = x.data_ptr<float>();
    for (int64_t i = 0; i < layers; ++i) {
      float* out = bufs[i % 2].data_ptr<float>();
      layer(k, p, i, lw[i], cur, out, tid, n);
      cur = out;
    }
    if (normed) {  // the model's final RMSNorm, each thread its share of the rows, into the other buffer
      int64_t r0, r1;
      split(R, tid, n, &r0, &r1);
      rms_norm(cur + r0 * H, norm->data_ptr<float>(), bufs[layers % 2].data_ptr<float>() + r0 * H, r1 - r0, H, p.eps);
    }
  }
  if (normed) return bufs[layers % 2];
  return layers == 0 ? x.clone() : bufs[(layers - 1) % 2];
}

int64_t lean_pass_isa() { return starjar_tiles::best_isa(); }

// As few_rows_stream: bit RB - 1 of mask streams AVX-512's float weight rows one at a time for RB input rows,
// bit 6 + RB - 1 VNNI's int8 ones, bit 18 + RB - 1 two runs of float rows at once, bit 24 + RB - 1 of int8 rows.
int64_t lean_pass_stream(int64_t mask) {
  TORCH_CHECK(mask >= 0 && mask < (1 << starjar_tiles::MASK_BITS),
              "lean_pass: a stream mask has bits for 1..6 rows, float then int8, then 7..12 float rows wide, then 1..6 "
              "rows twinned, float then int8 (", mask, ")");
  stream_mask.store(mask);
  return mask;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(starjar, m) {
  m.def("lean_pass(Tensor x, Tensor cos, Tensor sin_signed, Tensor? mask, Tensor[] ws, Tensor?[] bs, "
        "Tensor[] keys, Tensor[] values, int start, int kv_len, int[] nq, int[] nk, int d, float eps, "
        "float scaling, Tensor? write, int isa, Tensor[]? q8=None, Tensor[]? meta=None, Tensor? norm=None) -> Tensor");
  m.def("lean_pass_isa() -> int", lean_pass_isa);
  m.def("lean_pass_stream(int mask) -> int", lean_pass_stream);
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) { m.impl("lean_pass", lean_pass); }
