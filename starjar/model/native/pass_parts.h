// What the native passes (target_pass.cpp, draft_pass.cpp) share: elementwise work, each value rounded as ATen
// rounds it (the passes are built with -ffp-contract=off), and the choice of ATen's attention kernel.
#pragma once

#include <ATen/ATen.h>

#include <cmath>

namespace starjar_native {

// LlamaRMSNorm of each row of x [B, Q, H]. Its mean of squares is ATen's mean: the squares (pow 2 is x * x)
// summed by ATen's own reduction over the same shape, then divided by the count (mean is sum, then div_); then
// x * rsqrt(var + eps) and the weight, elementwise, in HF's order. (pow and mean as ATen calls cost 32 us a
// norm on one row; this, 6.)
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const float* xp = x.data_ptr<float>();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor sq = at::empty_like(x);
  float* sp = sq.data_ptr<float>();
  for (int64_t i = 0; i < rows * n; ++i) sp[i] = xp[i] * xp[i];
  const at::Tensor sums = at::sum(sq, {-1}, true);
  const float* total = sums.data_ptr<float>();
  at::Tensor out = at::empty_like(x);
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float var = total[r] / static_cast<float>(n);
    const float inv = 1.0f / std::sqrt(var + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) {
      const float h = xp[r * n + i] * inv;
      op[r * n + i] = wp[i] * h;
    }
  }
  return out;
}

// x + y into a new tensor (the residual), as the scripted `x + ...`.
inline at::Tensor residual(const at::Tensor& x, const at::Tensor& y) {
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) op[i] = xp[i] + yp[i];
  return out;
}

// Whether scaled_dot_product_attention would run its CPU flash kernel on these (dense 4-d float32 tensors with
// equal heads and head dims, as the layers give it): then that kernel is called directly, the same values
// without the backend selection's checks (about 25 us a call between the products; 0.8 ms a default step).
inline bool flash_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return at::globalContext().userEnabledFlashSDP() && q.stride(-1) == 1 && k.stride(-1) == 1 &&
         v.stride(-1) == 1 && q.size(1) == k.size(1) && q.size(-1) == k.size(-1) && k.size(-1) == v.size(-1) &&
         q.size(2) > 0 && k.size(2) > 0 && !q.requires_grad();
}

}  // namespace starjar_native
