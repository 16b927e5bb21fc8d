// An int8 product for a few rows with AVX-512 VNNI, or AVX2 without it: y = x W^T (+ b), W int8 per output
// channel, x quantized per row here.
//
// The int8 draft's products went through torch's dynamic kernel, which on a 2-core Xeon (AVX512, VNNI) read its
// weights at about half the memory's speed for one row and slower for more (the default draft's body: 12.0 ms
// for one row, 17.6 for 8, where its int8 weights stream in about 4). Here each tile of 4 weight rows is loaded
// once against every input row, 6 rows at a time, with the next tile prefetched, as the float product does
// (few_rows.cpp), and the sums are VNNI's u8 x s8 dot products into int32 (AVX2's: the same sums, widened to
// 16 bits and multiplied in pairs; forced by few_rows_use(1), as the float product's kernel is).
//
// Each row r is quantized to 8 unsigned bits over its own range (scale s_r, zero point z_r: quantize_row); a
// sum over k is exact in int32 (at most 255 * 128 * K), so y[r, n] = (sum - z_r * sum_k W[n, k]) * s_r *
// scale_n + b_n, each in float, in that order. A row's values
// do not depend on the rows or outputs beside it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "int8_tiles.h"

#include <algorithm>
#include <vector>

namespace {

using starjar_int8::has_avx2;
using starjar_int8::has_vnni;
using starjar_int8::Job;
using starjar_int8::KB;
using starjar_int8::NB;

}  // namespace

int64_t starjar_few_rows_forced_isa();  // few_rows.cpp
int64_t starjar_few_rows_int8_stream();  // few_rows.cpp: int8_tiles.h's mask (stream bits, then twin bits)

namespace {

// x [R, K] float32; w [N, Kp] int8 (K padded with zeros to a multiple of 64); meta [2, N] float32: each
// output's weight scale and the sum of its int8 weights; b [N] or none. -> [R, N].
at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& meta,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_vnni() || has_avx2(), "int8_rows needs AVX-512 VNNI or AVX2, which this CPU lacks");
  const bool vnni = has_vnni() && starjar_few_rows_forced_isa() != 1;
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
  std::vector<float> sx(R), zx(R);
  const float* xp = xc.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const auto [scale, zero] = starjar_int8::quantize(xp + r * K, K, Kp, xq.data() + r * Kp, vnni);
    sx[r] = scale, zx[r] = static_cast<float>(zero);
  }
  const float* mp = mc.data_ptr<float>();
  const Job job{xq.data(), sx.data(), zx.data(), wc.data_ptr<int8_t>(), mp, mp + N,
                bc.defined() ? bc.data_ptr<float>() : nullptr, y.data_ptr<float>(), Kp, N};
  const int64_t tiles = (N + NB - 1) / NB;
  const int64_t grain = std::max<int64_t>(1, (tiles + at::get_num_threads() - 1) / at::get_num_threads());
  const int64_t streamed = starjar_few_rows_int8_stream();
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {  // a thread's share in two halves: twinned or not
    const int64_t mid = t0 + (t1 - t0) / 2;
    starjar_int8::int8_two(job, R, t0, mid, mid, t1, vnni, streamed);
  });
  return y;
}

bool int8_rows_available() { return has_vnni() || has_avx2(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(starjar, m) {
  m.def("int8_rows(Tensor x, Tensor w, Tensor meta, Tensor? b=None) -> Tensor");
  m.def("int8_rows_available() -> bool", int8_rows_available);
  m.def("int8_rows_vnni() -> bool", has_vnni);
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) { m.impl("int8_rows", int8_rows); }
