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
// AVX2's kernel (AMD EPYC) streams a tile's weight rows one after another instead: tiles.h says why.
//
// Each output y[r, n] is summed in one fixed order, lanes of 16 over k (AVX2: 2 lanes of 8 over steps of 16), then the lanes reduced,
// then the bias: it does not depend on R, on which other rows or outputs share the call, or on the thread
// that computes it. So a row's values are the same alone or in any batch, and a fused q/k/v product gives the
// separate products' values. The order differs from MKL's, so this is a path of its own
// (starjar.cpu.skinny_linear chooses it per row bucket by measurement, like its other paths).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tiles.h"

#include <algorithm>
#include <atomic>
#include <memory>

namespace {

using starjar_tiles::best_isa;
using starjar_tiles::Isa;
using starjar_tiles::isa_of;
using starjar_tiles::NB;

// The kernel in use: 0 the best this CPU has, else forced (few_rows_use; tests force each).
std::atomic<int64_t> forced_isa{0};
// Which AVX-512 row counts stream their weight rows one at a time (few_rows_stream sets it): bits 0-5 the
// float product's (tiles.h's isa_of), bits 6-11 the int8 product's (int8_tiles.h's int8_range), bits 12-17 the
// float row counts 7..12 that take the wide tiles, bits 18-23 the streamed float row counts that twin, bits 24-29
// the streamed int8 row counts that twin.
std::atomic<int64_t> stream_mask{0};

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
  const Isa kernels = isa_of(which, stream_mask.load());
  const int64_t tiles = (N + NB - 1) / NB;
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles)));
  const std::unique_ptr<starjar_tiles::Share[]> shares(new starjar_tiles::Share[2 * n]);
  for (int t = 0; t < n; ++t) starjar_tiles::share_out(shares.get() + 2 * t, tiles * t / n, tiles * (t + 1) / n);
  const bool twin = starjar_tiles::twin_of(kernels, R);
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {  // each thread its share, then what the others leave
    for (int64_t t = b; t < e; ++t) {
      starjar_tiles::take_tiles(shares.get(), static_cast<int>(t), n, twin,
                                [&](int64_t a0, int64_t a1, int64_t c0, int64_t c1) {
        starjar_tiles::tiles_two(kernels, xp, wp, bp, yp, R, K, N, a0, a1, c0, c1);
      });
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

// Stream AVX-512's weight rows one at a time for RB input rows where bit RB - 1 of mask is set, the int8
// product's where bit 6 + RB - 1 is, two runs of them at once where bit 18 + RB - 1 (float) or 24 + RB - 1 (int8) is
// too (measured per machine; the values do not change); returns the mask in use.
int64_t few_rows_stream(int64_t mask) {
  TORCH_CHECK(mask >= 0 && mask < (1 << starjar_tiles::MASK_BITS),
              "few_rows: a stream mask has bits for 1..6 rows, float then int8, then 7..12 float rows wide, then 1..6 "
              "rows twinned, float then int8 (", mask, ")");
  stream_mask.store(mask);
  return mask;
}

}  // namespace

// The kernel forced for the library's products (0: the best), read by the int8 product (int8_rows.cpp).
int64_t starjar_few_rows_forced_isa() { return forced_isa.load(); }

// The int8 product's stream mask (int8_rows.cpp): bit RB - 1 streams VNNI's weight rows for RB input rows, bit
// 6 + RB - 1 twins them.
int64_t starjar_few_rows_int8_stream() { return starjar_tiles::int8_bits(stream_mask.load()); }

// A fragment: the native passes' library defines the rest of the namespace.
TORCH_LIBRARY_FRAGMENT(starjar, m) {
  m.def("few_rows(Tensor x, Tensor w, Tensor? b=None) -> Tensor");
  m.def("few_rows_isa() -> int", few_rows_isa);
  m.def("few_rows_use(int isa) -> int", few_rows_use);
  m.def("few_rows_stream(int mask) -> int", few_rows_stream);
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) { m.impl("few_rows", few_rows); }
