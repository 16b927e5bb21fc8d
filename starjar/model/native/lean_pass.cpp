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

#include "../../cpu/native/tiles.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

using starjar_tiles::Isa;
using starjar_tiles::NB;

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

struct Kernels {
  Isa tiles;
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float*, float, const float*, int64_t);
};

Kernels kernels_of(int64_t isa) {
  if (isa == 2) return {starjar_tiles::isa_of(2), dot512, axpy512};
  return {starjar_tiles::isa_of(1), dot256, axpy256};
}

// One layer's weights (fused q/k/v and gate/up, as target_pass.cpp takes them) and its K/V buffers [B, nk, L, d].
struct Layer {
  const float *norm1, *qkv, *qkv_b, *o, *o_b, *norm2, *gu, *gu_b, *down, *down_b;
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
  float *h, *scores, *qrot;           // per thread: [R, H], [kv_len], [d]
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

// The product's tiles this thread owns: y = x W^T (+ b), and where `residual` is given y += residual there.
void product(const Kernels& k, const float* x, const float* w, const float* b, float* y, int64_t R, int64_t K,
             int64_t N, int tid, int n, const float* residual) {
  int64_t t0, t1;
  split((N + NB - 1) / NB, tid, n, &t0, &t1);
  starjar_tiles::tiles_range(k.tiles, x, w, b, y, R, K, N, t0, t1);
  if (residual == nullptr) return;
  const int64_t n0 = t0 * NB, n1 = std::min<int64_t>(t1 * NB, N);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = n0; i < n1; ++i) y[r * N + i] = residual[r * N + i] + y[r * N + i];
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

// Attention of every (token, query head): softmax(q k^T scaling + mask) v over kv_len keys, in one sweep.
void attend(const Kernels& k, const Pass& p, const Layer& L, int tid, int n) {
  const int64_t heads_n = L.nq + 2 * L.nk, g = L.nq / L.nk, d = p.d;
  float* sc = p.scores + tid * p.kv_len;
  float* q = p.qrot + tid * d;
  const float hidden = std::numeric_limits<float>::lowest() / 2;  // a mask this low hides the key
  int64_t i0, i1;
  split(p.R * L.nq, tid, n, &i0, &i1);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t r = i / L.nq, hq = i % L.nq, b = r / p.Q, t = r % p.Q, j = hq / g;
    rotate(p, r, p.heads + (r * heads_n + hq) * d, q);
    const float* keys = L.kp + b * L.ks[0] + j * L.ks[1];
    const float* vals = L.vp + b * L.vs[0] + j * L.vs[1];
    const float* m = p.mask != nullptr ? p.mask + b * p.mask_s[0] + t * p.mask_s[2] : nullptr;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < p.kv_len; ++s) {
      const float add = m != nullptr ? m[s * p.mask_s[3]] : 0.0f;
      sc[s] = add <= hidden ? -std::numeric_limits<float>::infinity()
                            : k.dot(q, keys + s * L.ks[2], d) * p.scaling + add;
      top = std::max(top, sc[s]);
    }
    float* out = p.att + r * L.nq * d + hq * d;
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
void gated(const Pass& p, const Layer& L, int tid, int n) {
  int64_t i0, i1;
  split(p.R * L.inner, tid, n, &i0, &i1);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t r = i / L.inner, e = i % L.inner;
    const float gate = p.gu[r * 2 * L.inner + e];
    p.act[i] = (gate / (1.0f + std::exp(-gate))) * p.gu[r * 2 * L.inner + L.inner + e];
  }
}

// One layer, by one thread of the region: x [R, H] in, out [R, H] written.
void layer(const Kernels& k, const Pass& p, const Layer& L, const float* x, float* out, int tid, int n) {
  float* h = p.h + tid * p.R * p.H;
  const int64_t heads_n = L.nq + 2 * L.nk;
  rms_norm(x, L.norm1, h, p.R, p.H, p.eps);
  product(k, h, L.qkv, L.qkv_b, p.heads, p.R, p.H, heads_n * p.d, tid, n, nullptr);
#pragma omp barrier
  write_kv(p, L, tid, n);
#pragma omp barrier
  attend(k, p, L, tid, n);
#pragma omp barrier
  product(k, p.att, L.o, L.o_b, p.y, p.R, L.nq * p.d, p.H, tid, n, x);
#pragma omp barrier
  rms_norm(p.y, L.norm2, h, p.R, p.H, p.eps);
  product(k, h, L.gu, L.gu_b, p.gu, p.R, p.H, 2 * L.inner, tid, n, nullptr);
#pragma omp barrier
  gated(p, L, tid, n);
#pragma omp barrier
  product(k, p.act, L.down, L.down_b, out, p.R, L.inner, p.H, tid, n, p.y);
#pragma omp barrier
}

const float* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<float>() : nullptr;
}

std::vector<Layer> layers_of(const c10::List<at::Tensor>& ws, const c10::List<std::optional<at::Tensor>>& bs,
                             const c10::List<at::Tensor>& keys, const c10::List<at::Tensor>& values,
                             at::IntArrayRef nq, at::IntArrayRef nk, int64_t B, int64_t H, int64_t d) {
  const int64_t n = static_cast<int64_t>(nq.size());
  TORCH_CHECK(ws.size() == 6 * n && bs.size() == 4 * n && keys.size() == n && values.size() == n,
              "lean_pass: six weights and four biases a layer, and each layer's K and V");
  std::vector<Layer> out;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < 6; ++j) {
      const at::Tensor& w = ws.get(i * 6 + j);
      TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous(), "lean_pass: contiguous float32 weights");
    }
    for (int64_t j = 0; j < 4; ++j) {
      const auto b = bs.get(i * 4 + j);
      TORCH_CHECK(!b.has_value() || !b->defined() || (b->scalar_type() == at::kFloat && b->is_contiguous()),
                  "lean_pass: contiguous float32 biases");
    }
    const at::Tensor &kt = keys.get(i), &vt = values.get(i);
    TORCH_CHECK(nk[i] > 0 && nq[i] % nk[i] == 0, "lean_pass: query heads a multiple of the KV heads");
    TORCH_CHECK(kt.scalar_type() == at::kFloat && vt.scalar_type() == at::kFloat && kt.dim() == 4 && vt.dim() == 4 &&
                kt.size(0) == B && vt.size(0) == B && kt.size(1) == nk[i] && vt.size(1) == nk[i] &&
                kt.size(3) == d && vt.size(3) == d && kt.stride(3) == 1 && vt.stride(3) == 1,
                "lean_pass: float32 K/V buffers [B, nk, L, d], dense in d");
    const int64_t inner = ws.get(i * 6 + 4).size(0) / 2;
    TORCH_CHECK(ws.get(i * 6).numel() == H && ws.get(i * 6 + 3).numel() == H &&
                ws.get(i * 6 + 1).size(0) == (nq[i] + 2 * nk[i]) * d && ws.get(i * 6 + 1).size(1) == H &&
                ws.get(i * 6 + 2).size(0) == H && ws.get(i * 6 + 2).size(1) == nq[i] * d &&
                ws.get(i * 6 + 4).size(1) == H && ws.get(i * 6 + 5).size(0) == H && ws.get(i * 6 + 5).size(1) == inner,
                "lean_pass: the weights' shapes do not match the hidden size and heads");
    Layer L{ws.get(i * 6).data_ptr<float>(), ws.get(i * 6 + 1).data_ptr<float>(), data_or_null(bs.get(i * 4)),
            ws.get(i * 6 + 2).data_ptr<float>(), data_or_null(bs.get(i * 4 + 1)), ws.get(i * 6 + 3).data_ptr<float>(),
            ws.get(i * 6 + 4).data_ptr<float>(), data_or_null(bs.get(i * 4 + 2)), ws.get(i * 6 + 5).data_ptr<float>(),
            data_or_null(bs.get(i * 4 + 3)), nq[i], nk[i], inner, kt.data_ptr<float>(), vt.data_ptr<float>(), {}, {}};
    for (int a = 0; a < 4; ++a) {
      L.ks[a] = kt.stride(a);
      L.vs[a] = vt.stride(a);
    }
    out.push_back(L);
  }
  return out;
}

// Every layer of a pass: x [B, Q, H]; ws six weights a layer (input norm, qkv, o, post norm, gate-up, down),
// bs four biases a layer; cos and sin_signed each token's [d]; mask additive [B, 1, Q, >= kv_len] or None;
// keys and values the rows' buffers, written as one span from `start` or each token at write [B, Q]; isa 0 the
// best this CPU has, 1 AVX2, 2 AVX-512. Returns the hidden states after the last layer [B, Q, H].
at::Tensor lean_pass(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                     const std::optional<at::Tensor>& mask, const c10::List<at::Tensor>& ws,
                     const c10::List<std::optional<at::Tensor>>& bs, const c10::List<at::Tensor>& keys,
                     const c10::List<at::Tensor>& values, int64_t start, int64_t kv_len, at::IntArrayRef nq,
                     at::IntArrayRef nk, int64_t d, double eps, double scaling, const std::optional<at::Tensor>& write,
                     int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3, "lean_pass takes float32 [B, Q, H]");
  const int64_t best = starjar_tiles::best_isa(), which = isa == 0 ? best : isa;
  TORCH_CHECK(which >= 1 && which <= best, "lean_pass: this CPU lacks the instructions asked for (", isa, ")");
  const int64_t B = x.size(0), Q = x.size(1), H = x.size(2), R = B * Q;
  const std::vector<Layer> lw = layers_of(ws, bs, keys, values, nq, nk, B, H, d);
  const at::Tensor c = cos.contiguous(), s = sin_signed.contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat && c.numel() == R * d &&
              s.numel() == R * d, "lean_pass: cos and sin must hold each token's position");
  int64_t width = 0, inner = 0, att_w = 0;
  TORCH_CHECK(d > 0 && d <= MAX_D && d % 2 == 0, "lean_pass: an even head dimension up to ", MAX_D);
  for (int64_t l = 0; l < static_cast<int64_t>(lw.size()); ++l) {
    const Layer& L = lw[l];
    TORCH_CHECK(kv_len >= 0 && kv_len <= keys.get(l).size(2) && kv_len <= values.get(l).size(2),
                "lean_pass: kv_len past the KV buffers");
    width = std::max(width, (L.nq + 2 * L.nk) * d);
    inner = std::max(inner, L.inner);
    att_w = std::max(att_w, L.nq * d);
  }
  at::Tensor at_pos;
  if (write.has_value() && write->defined()) {
    at_pos = write->to(at::kLong).contiguous();
    TORCH_CHECK(at_pos.numel() == R, "lean_pass: write must hold each token's cache position");
    const int64_t* wp = at_pos.data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t l = 0; l < static_cast<int64_t>(lw.size()); ++l) {
        TORCH_CHECK(wp[i] >= 0 && wp[i] < keys.get(l).size(2) && wp[i] < values.get(l).size(2),
                    "lean_pass: a write position lies outside the KV buffers");
      }
    }
  } else {
    for (int64_t l = 0; l < static_cast<int64_t>(lw.size()); ++l) {
      TORCH_CHECK(start >= 0 && start + Q <= keys.get(l).size(2) && start + Q <= values.get(l).size(2),
                  "lean_pass: the written span lies outside the KV buffers");
    }
  }
  const bool masked = mask.has_value() && mask->defined();
  if (masked) {
    TORCH_CHECK(mask->scalar_type() == at::kFloat && mask->dim() == 4 && mask->size(0) == B && mask->size(2) == Q &&
                mask->size(3) >= kv_len, "lean_pass: an additive float32 mask [B, 1, Q, >= kv_len]");
  }
  const int nt = std::max(1, at::get_num_threads());
  const auto opts = x.options();
  at::Tensor scratch = at::empty({R * (width + att_w + H + 3 * inner) + nt * (R * H + kv_len + d)}, opts);
  float* sp = scratch.data_ptr<float>();
  Pass p{B, Q, H, R, d, start, kv_len, static_cast<float>(eps), static_cast<float>(scaling), c.data_ptr<float>(),
         s.data_ptr<float>(), at_pos.defined() ? at_pos.data_ptr<int64_t>() : nullptr,
         masked ? mask->data_ptr<float>() : nullptr, {}, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
         nullptr, nullptr};
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
  p.qrot = p.scores + nt * kv_len;
  at::Tensor bufs[2] = {at::empty_like(x), at::empty_like(x)};
  const Kernels k = kernels_of(which);
  const int64_t layers = static_cast<int64_t>(lw.size());
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    const float* cur = x.data_ptr<float>();
    for (int64_t i = 0; i < layers; ++i) {
      float* out = bufs[i % 2].data_ptr<float>();
      layer(k, p, lw[i], cur, out, tid, n);
      cur = out;
    }
  }
  return layers == 0 ? x.clone() : bufs[(layers - 1) % 2];
}

int64_t lean_pass_isa() { return starjar_tiles::best_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(starjar, m) {
  m.def("lean_pass(Tensor x, Tensor cos, Tensor sin_signed, Tensor? mask, Tensor[] ws, Tensor?[] bs, "
        "Tensor[] keys, Tensor[] values, int start, int kv_len, int[] nq, int[] nk, int d, float eps, "
        "float scaling, Tensor? write, int isa) -> Tensor");
  m.def("lean_pass_isa() -> int", lean_pass_isa);
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) { m.impl("lean_pass", lean_pass); }
