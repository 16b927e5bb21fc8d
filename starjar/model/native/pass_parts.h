// What the native passes (target_pass.cpp, draft_pass.cpp) share: elementwise work, each value rounded as ATen
// rounds it (the passes are built with -ffp-contract=off), and the choice of ATen's attention kernel.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

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

// A long pass's attention in query chunks, each over the keys its rows may see rounded up to whole blocks of
// the CPU flash kernel's keys. That kernel sums a query row's keys in blocks of FLASH_KV_BLOCK whatever the
// queries are; a block no row of a chunk may see adds exact zeros to its sums, so leaving such blocks out changes
// no bit (tests/starjar/test_native_pass.py checks it on the running machine), while a prompt's first rows stop
// paying for the keys after them: one pass over a 941-token prompt attends 0.75 of the full square's keys, a
// 2,048-token one 0.63.
constexpr int64_t FLASH_KV_BLOCK = 512;  // ATen's kv_split_size for the CPU flash kernel
constexpr int64_t CHUNK_ROWS = 128;      // query rows a chunk's extent is read for

struct Chunk {
  int64_t m0, m1, keys;  // query rows [m0, m1) attend keys [0, keys)
  std::optional<at::Tensor> mask = std::nullopt;  // the pass's mask for those rows and keys, where it has one
};

// The chunks of a pass of Q query rows over kv_len keys, from its additive mask [B, 1, >= Q, kv_len] (rows 0..Q-1
// hold each query's row: the folded mask's first copy): one chunk over every key where no block can be left out.
inline std::vector<Chunk> key_chunks(const std::optional<at::Tensor>& mask, int64_t Q, int64_t kv_len) {
  if (!mask.has_value() || !mask->defined() || Q <= 1 || kv_len <= FLASH_KV_BLOCK ||
      mask->scalar_type() != at::kFloat || mask->dim() != 4 || mask->size(2) < Q || mask->size(3) != kv_len) {
    return {{0, Q, kv_len}};
  }
  const float* mp = mask->data_ptr<float>();
  const auto st = mask->strides();
  const float hidden = std::numeric_limits<float>::lowest() / 2;
  std::vector<Chunk> chunks;
  for (int64_t m0 = 0; m0 < Q; m0 += CHUNK_ROWS) {
    const int64_t m1 = std::min(Q, m0 + CHUNK_ROWS);
    int64_t seen = 0;  // keys [0, seen) hold every key a row of the chunk may see
    for (int64_t b = 0; b < mask->size(0); ++b) {
      for (int64_t t = m0; t < m1; ++t) {
        const float* row = mp + b * st[0] + t * st[2];
        int64_t c = kv_len;
        while (c > seen && !(row[(c - 1) * st[3]] > hidden)) --c;
        seen = std::max(seen, c);
      }
    }
    const int64_t keys = std::min(kv_len, (seen + FLASH_KV_BLOCK - 1) / FLASH_KV_BLOCK * FLASH_KV_BLOCK);
    if (!chunks.empty() && chunks.back().keys == keys) {
      chunks.back().m1 = m1;
    } else {
      chunks.push_back({m0, m1, std::max<int64_t>(keys, 1)});
    }
  }
  return chunks;
}

}  // namespace starjar_native
