// An int8 product for a few rows with AVX-512 VNNI: y = x W^T (+ b), W int8 per output channel, x quantized
// per row here.
//
// The int8 draft's products went through torch's dynamic kernel, which on a 2-core Xeon (AVX512, VNNI) read its
// weights at about half the memory's speed for one row and slower for more (the default draft's body: 12.0 ms
// for one row, 17.6 for 8, where its int8 weights stream in about 4). Here each tile of 4 weight rows is loaded
// once against every input row, 6 rows at a time, with the next tile prefetched, as the float product does
// (few_rows.cpp), and the sums are VNNI's u8 x s8 dot products into int32.
//
// Each row r is quantized symmetrically to 8 bits by its own peak (s_r = max|x_r| / 127, q = round(x * 127 /
// max|x_r|), ties to even) and offset by 128 to be unsigned; a sum over k is exact in int32 (at most 255 * 128 * K), so
// y[r, n] = (sum - 128 * sum_k W[n, k]) * s_r * scale_n + b_n, each in float, in that order. A row's values
// do not depend on the rows or outputs beside it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t NB = 4;    // weight rows a tile holds
constexpr int64_t KB = 64;   // bytes a VNNI step takes; K is padded to a multiple of it
constexpr int RMAX = 6;      // input rows a tile holds

bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

struct Job {
  const uint8_t* xq;     // [R, Kp], each row's values + 128
  const float* scale_x;  // [R]
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
    const float sx = j.scale_x[r0 + r];
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t n = n0 + i;
      const float v = static_cast<float>(sums[r][i]) - 128.0f * j.sum_w[n];
      const float out = v * sx * j.scale_w[n];
      j.y[(r0 + r) * j.N + n] = j.b != nullptr ? out + j.b[n] : out;
    }
  }
}

using Tile = void (*)(const Job&, int64_t, int64_t, int64_t);
constexpr Tile TILES[RMAX] = {tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Row r of x [R, K] quantized into xq [R, Kp] (the padding 128: zero); returns its scale. q = x * (127 / peak),
// rounded to nearest, ties to even (the default rounding mode), within [-127, 127] by construction.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) float quantize_row(const float* x, int64_t K, int64_t Kp,
                                                                          uint8_t* xq) {
  __m512 peak16 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= K; i += 16) peak16 = _mm512_max_ps(peak16, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float peak = _mm512_reduce_max_ps(peak16);
  for (; i < K; ++i) peak = std::max(peak, std::fabs(x[i]));
  const float inv = peak > 0.0f ? 127.0f / peak : 0.0f;
  const __m512 inv16 = _mm512_set1_ps(inv);
  const __m512i offset = _mm512_set1_epi32(128);
  for (i = 0; i + 16 <= K; i += 16) {
    const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv16)), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i), _mm512_cvtepi32_epi8(q));
  }
  for (; i < K; ++i) xq[i] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(x[i] * inv)) + 128);
  std::fill(xq + K, xq + Kp, static_cast<uint8_t>(128));
  return peak > 0.0f ? peak / 127.0f : 1.0f;
}

// x [R, K] float32; w [N, Kp] int8 (K padded with zeros to a multiple of 64); meta [2, N] float32: each
// output's weight scale and the sum of its int8 weights; b [N] or none. -> [R, N].
at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& meta,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_vnni(), "int8_rows needs AVX-512 VNNI, which this CPU lacks");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && w.scalar_type() == at::kChar && w.dim() == 2 &&
              w.size(1) % KB == 0 && w.size(1) >= x.size(1) && w.size(1) < x.size(1) + KB,
              "int8_rows takes float32 x [R, K] and int8 W [N, K padded to a multiple of 64]");
  TORCH_CHECK(meta.scalar_type() == at::kFloat && meta.dim() == 2 && meta.size(0) == 2 && meta.size(1) == w.size(0),
              "int8_rows: meta holds each output's scale and weight sum [2, N]");
  const int64_t R = x.size(0), K = x.size(1), Kp = w.size(1), N = w.size(0);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), mc = meta.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, "int8_rows: one float32 bias an output");
  }
  at::Tensor y = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return y;
  std::vector<uint8_t> xq(R * Kp);
  std::vector<float> sx(R);
  const float* xp = xc.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) sx[r] = quantize_row(xp + r * K, K, Kp, xq.data() + r * Kp);
  const float* mp = mc.data_ptr<float>();
  const Job job{xq.data(), sx.data(), wc.data_ptr<int8_t>(), mp, mp + N,
                bc.defined() ? bc.data_ptr<float>() : nullptr, y.data_ptr<float>(), Kp, N};
  const int64_t tiles = (N + NB - 1) / NB;
  const int64_t grain = std::max<int64_t>(1, (tiles + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NB, nb = std::min<int64_t>(NB, N - n0);
      for (int64_t r0 = 0; r0 < R; r0 += RMAX) TILES[std::min<int64_t>(RMAX, R - r0) - 1](job, r0, n0, nb);
    }
  });
  return y;
}

bool int8_rows_available() { return has_vnni(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(starjar, m) {
  m.def("int8_rows(Tensor x, Tensor w, Tensor meta, Tensor? b=None) -> Tensor");
  m.def("int8_rows_available() -> bool", int8_rows_available);
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) { m.impl("int8_rows", int8_rows); }
