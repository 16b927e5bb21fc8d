// A float32 product for a few rows, y = x W^T (+ b): x [R, K], W [N, K] (nn.Linear's layout), y [R, N].
//
// Verification, batched decoding and drafting multiply a few rows (1 to 64) by weights that stream from memory.
// A pass over them should cost about what one row costs: the weights are read once whatever R is. MKL's sgemm
// does not hold to that on a 2-core Xeon with AVX-512 (its output layer over 12 rows took 19.9 ms, one row
// 4.0). Here each tile of 4 weight rows is loaded once, while it sits in L1, against every input row, 6 input
// rows at a time (24 accumulators), the tiles split between the threads. A weight row is short (2.3 KB for the
// default target), too short for the hardware prefetcher to run ahead of 4 interleaved rows: the next tile is
// prefetched while this one is summed (a 4-row product of that target's gate/up weights: 381 -> 254 us, one row
// 231; MKL's packed sgemm 315 and 246 in the same turns), and past 6 rows the one after it into L2 while the
// later rows are summed from L1 (12 rows: 578 -> 450 us; MKL packed 782).
//
// Each output y[r, n] is summed in one fixed order, lanes of 16 (8 with AVX2) over k, then the lanes reduced,
// then the bias: it does not depend on R, on which other rows or outputs share the call, or on the thread
// that computes it. So a row's values are the same alone or in any batch, and a fused q/k/v product gives the
// separate products' values. The order differs from MKL's, so this is a path of its own
// (starjar.cpu.skinny_linear chooses it per row bucket by measurement, like its other paths).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>

namespace {

constexpr int64_t NB = 4;  // weight rows a tile holds

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

// The AVX2 tile: lanes of 8 (16 registers: 4 x 2 accumulators, 4 weights, one input). The tail of k past the
// last full lane is summed one by one after the lanes, in order.
__attribute__((target("avx2,fma"))) inline float reduce256(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <int RB>
__attribute__((target("avx2,fma"))) void tile256(const float* x, const float* w, const float* b, float* y,
                                                 int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t nb) {
  __m256 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = w + (n0 + std::min<int64_t>(j, nb - 1)) * K;
  const int64_t full = K - K % 8;
  for (int64_t k = 0; k < full; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm256_loadu_ps(wr[j] + k);
      if (r0 == 0 && k % 16 == 0) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + NB * K + k), _MM_HINT_T0);
    }
    for (int r = 0; r < RB; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + (r0 + r) * K + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  float sums[RB][NB];
  for (int r = 0; r < RB; ++r) {
    for (int j = 0; j < NB; ++j) {
      float s = reduce256(acc[r][j]);
      for (int64_t k = full; k < K; ++k) s += x[(r0 + r) * K + k] * wr[j][k];
      sums[r][j] = s;
    }
  }
  store(sums[0], RB, b, y, N, r0, n0, nb);
}

using Tile = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                      int64_t);

// Tiles for 1..max input rows at a time: the AVX-512 kernel keeps 6 rows x 4 outputs in 24 registers, AVX2's
// 2 x 4 in 8.
struct Isa {
  Tile tiles[6];
  int max;
};

Isa isa_of(int64_t which) {
  if (which == 2) return {{tile512<1>, tile512<2>, tile512<3>, tile512<4>, tile512<5>, tile512<6>}, 6};
  return {{tile256<1>, tile256<2>, nullptr, nullptr, nullptr, nullptr}, 2};
}

// The best this CPU has: 2 AVX-512, 1 AVX2 with FMA, 0 neither (no path here).
int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

// The kernel in use: 0 the best this CPU has, else forced (few_rows_use; tests force each).
std::atomic<int64_t> forced_isa{0};

at::Tensor few_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() == 2 && w.dim() == 2 &&
              x.size(1) == w.size(1), "few_rows takes float32 x [R, K] and W [N, K]");
  const int64_t best = best_isa(), isa = forced_isa.load();
  const int64_t which = isa == 0 ? best : isa;
  TORCH_CHECK(which >= 1, "few_rows: this CPU has neither AVX2 with FMA nor AVX-512");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const bool biased = bias.has_value() && bias->defined();
  at::Tensor bc;
  if (biased) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == w.size(0), "few_rows: one float32 bias an output");
  }
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = biased ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const Isa kernels = isa_of(which);
  const int64_t tiles = (N + NB - 1) / NB;
  const int64_t grain = std::max<int64_t>(1, (tiles + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NB, nb = std::min<int64_t>(NB, N - n0);
      for (int64_t r0 = 0; r0 < R; r0 += kernels.max) {
        const int64_t rb = std::min<int64_t>(kernels.max, R - r0);
        kernels.tiles[rb - 1](xp, wp, bp, yp, K, N, r0, n0, nb);
      }
    }
  });
  return y;
}

int64_t few_rows_isa() { return best_isa(); }

// Force a kernel (1 AVX2, 2 AVX-512) or go back to the best (0); returns the kernel now in use.
int64_t few_rows_use(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= best_isa(), "few_rows: this CPU lacks the instructions asked for (", isa, ")");
  forced_isa.store(isa);
  return isa == 0 ? best_isa() : isa;
}

}  // namespace

// A fragment: the native passes' library defines the rest of the namespace.
TORCH_LIBRARY_FRAGMENT(starjar, m) {
  m.def("few_rows(Tensor x, Tensor w, Tensor? b=None) -> Tensor");
  m.def("few_rows_isa() -> int", few_rows_isa);
  m.def("few_rows_use(int isa) -> int", few_rows_use);
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) { m.impl("few_rows", few_rows); }
