// A float32 Llama-family target's chain pass (B rows x Q tokens, every layer) over fused projections, as one
// native call: the one-row step, verification and multi-row decoding on consecutive slots.
//
// The scripted layers (starjar/model/target_step.py, _fused_step and _fused_rows_layer) dispatch about 45 small ops per layer from
// the TorchScript interpreter; on 2 cores that glue cost 6-9 ms of a 35 ms step. Here every sum is ATen's own
// (the products, RMSNorm's mean, attention, SiLU), called with the shapes the scripted step gives them, and
// only the elementwise work between them is written out, each value rounded as ATen rounds it (built with
// -ffp-contract=off, so no product and sum fuse into one rounding). The result is the scripted step's, bit
// for bit (tests/starjar/test_native_pass.py checks that on the running machine; starjar/model/native_pass.py
// builds and loads it).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "pass_parts.h"

#include <cmath>
#include <vector>

namespace {

using Biases = c10::List<std::optional<at::Tensor>>;
using starjar_native::flash_applies;
using starjar_native::residual;
using starjar_native::rms_norm;

// MKL's packed sgemm, the op skinny_linear's packed path calls.
at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w,
                      const std::optional<at::Tensor>& b, int64_t rows) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkl::_mkl_linear", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, w, b, rows);
}

// starjar's own few-rows product (starjar/cpu/native/few_rows.cpp, loaded where skinny_linear chose it).
at::Tensor own_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("starjar::few_rows", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(x, w, b);
}

// target_step._linear over x [B, Q, K] contiguous, as each path computes it, -> [B, Q, N] contiguous. Path 0
// is F.linear as at::linear computes it for a contiguous 3-d input (addmm over the [B Q, K] view with a bias,
// else mm, as at::matmul folds it), called without linear's and matmul's glue; 1 is W @ x.T (then the bias);
// 2 is MKL's packed sgemm; 3 starjar's own (skinny_linear's "rows").
at::Tensor product(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t path,
                   const std::optional<at::Tensor>& packed) {
  const int64_t k = x.size(-1), rows = x.numel() / k;
  const at::Tensor flat = x.view({rows, k});
  const bool biased = b.has_value() && b->defined();
  at::Tensor out;
  if (path == 3) {
    out = own_linear(flat, w, b);
  } else if (path == 2 && packed.has_value() && packed->defined()) {
    out = mkl_linear(flat, *packed, w, b, rows);
  } else if (path == 0) {
    out = biased ? at::addmm(*b, flat, w.t()) : at::mm(flat, w.t());
  } else {
    out = at::mm(w, flat.t()).t();
    if (biased) out = out + *b;
  }
  return out.reshape({x.size(0), x.size(1), w.size(0)}).contiguous();
}

// scaled_dot_product_attention over dense query, keys and values: its CPU flash kernel called directly where it
// would run (flash_applies).
at::Tensor attention(const at::Tensor& query, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double scaling) {
  return flash_applies(query, k, v)
      ? std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, false, mask, scaling))
      : at::scaled_dot_product_attention(query, k, v, mask, 0.0, false, scaling);
}

struct Pass {
  const std::vector<starjar_native::Chunk>* chunks;  // the query rows' key extents (key_chunks), one for all rows
  int64_t start, kv_len, d;
  double eps, scaling;
  const float* cos;  // [B, Q, d]: each token's position
  const float* sin_signed;
  const int64_t* write;  // [B, Q]: each token's cache position, or null: one span from `start`
};

// One layer over x [B, Q, H]: heads [B, Q, nq + 2 nk, d] from the qkv product; q and k rotated into [B, nq + nk,
// Q, d] (rotate_half a swap of halves, its sign in sin_signed); k and v written into the rows' buffers
// [B, nk, L, d] (from `start`, or where `write` says); attention over kv_len keys with the mask (folded for grouped heads when Q > 1),
// a long pass's query rows in chunks over the key blocks each may see (pass_parts.h, key_chunks).
at::Tensor layer(const at::Tensor& x, const Pass& p, const std::optional<at::Tensor>& mask,
                 const c10::List<at::Tensor>& ws, const Biases& bs, const Biases& packs, at::IntArrayRef paths,
                 int64_t i, const at::Tensor& keys, const at::Tensor& values, int64_t nq, int64_t nk) {
  const int64_t w = i * 6, o = i * 4, B = x.size(0), Q = x.size(1), d = p.d, heads_n = nq + 2 * nk;
  at::Tensor h = rms_norm(x, ws.get(w), p.eps);
  const at::Tensor heads = product(h, ws.get(w + 1), bs.get(o), paths[o], packs.get(o));
  const float* hp = heads.data_ptr<float>();
  at::Tensor rot = at::empty({B, nq + nk, Q, d}, x.options());
  float* rp = rot.data_ptr<float>();
  const int64_t half = d / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Q; ++t) {
      const float* c = p.cos + (b * Q + t) * d;
      const float* s = p.sin_signed + (b * Q + t) * d;
      for (int64_t j = 0; j < nq + nk; ++j) {
        const float* src = hp + ((b * Q + t) * heads_n + j) * d;
        float* dst = rp + ((b * (nq + nk) + j) * Q + t) * d;
        for (int64_t e = 0; e < d; ++e) {
          const float a = src[e] * c[e];
          const float r = src[e < half ? e + half : e - half] * s[e];
          dst[e] = a + r;
        }
      }
    }
  }
  const auto ks = keys.strides();
  const auto vs = values.strides();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t t = 0; t < Q; ++t) {
        const int64_t pos = p.write != nullptr ? p.write[b * Q + t] : p.start + t;
        float* kd = kp + b * ks[0] + j * ks[1] + pos * ks[2];
        float* vd = vp + b * vs[0] + j * vs[1] + pos * vs[2];
        const float* kr = rp + ((b * (nq + nk) + nq + j) * Q + t) * d;
        const float* vr = hp + ((b * Q + t) * heads_n + nq + nk + j) * d;
        for (int64_t e = 0; e < d; ++e) {
          kd[e * ks[3]] = kr[e];
          vd[e * vs[3]] = vr[e];
        }
      }
    }
  }
  const int64_t g = nq / nk;
  at::Tensor att;
  if (p.chunks->size() == 1) {
    at::Tensor query = rot.narrow(1, 0, nq);
    if (g != 1) query = query.reshape({B, nk, g * Q, d});
    att = attention(query, keys.narrow(2, 0, p.kv_len), values.narrow(2, 0, p.kv_len), mask, p.scaling);
    if (g != 1) att = att.reshape({B, nq, Q, d});
  } else {  // a long pass: each chunk of query rows over the key blocks they may see
    att = at::empty({B, nq, Q, d}, x.options());
    for (const starjar_native::Chunk& c : *p.chunks) {
      const int64_t rows = c.m1 - c.m0;
      at::Tensor query = rot.narrow(1, 0, nq).narrow(2, c.m0, rows);
      if (g != 1) query = query.reshape({B, nk, g * rows, d});
      const at::Tensor out = attention(query.contiguous(), keys.narrow(2, 0, c.keys), values.narrow(2, 0, c.keys),
                                       c.mask, p.scaling);
      att.narrow(2, c.m0, rows).copy_(out.reshape({B, nq, rows, d}));
    }
  }
  att = att.transpose(1, 2).contiguous().view({B, Q, nq * d});
  const at::Tensor y = residual(x, product(att, ws.get(w + 2), bs.get(o + 1), paths[o + 1], packs.get(o + 1)));
  h = rms_norm(y, ws.get(w + 3), p.eps);
  const at::Tensor gate_up = product(h, ws.get(w + 4), bs.get(o + 2), paths[o + 2], packs.get(o + 2));
  const int64_t inner = gate_up.size(-1) / 2;
  const at::Tensor act = at::silu(gate_up.narrow(-1, 0, inner));  // [B, Q, inner], contiguous
  // Where the down product is W @ x.T, HF's forward got gate and up from W @ x.T too, transposed, so the down
  // product's input lies there as [inner, rows] in memory; MKL's sums depend on that layout (a 2-core AMD
  // EPYC, AVX2), so it is written so here.
  const bool columns = paths[o + 3] == 1;
  const int64_t rows = B * Q;
  at::Tensor prod = columns ? at::empty({inner, rows}, x.options()) : at::empty_like(act);
  const float* ap = act.data_ptr<float>();
  const float* gp = gate_up.data_ptr<float>();
  float* pp = prod.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < inner; ++e) {
      pp[columns ? e * rows + r : r * inner + e] = ap[r * inner + e] * gp[r * 2 * inner + inner + e];
    }
  }
  if (columns) {
    const std::optional<at::Tensor>& b = bs.get(o + 3);
    at::Tensor down = at::mm(ws.get(w + 5), prod).t();
    if (b.has_value() && b->defined()) down = down + *b;
    return residual(y, down.reshape({B, Q, x.size(2)}).contiguous());
  }
  return residual(y, product(prod, ws.get(w + 5), bs.get(o + 3), paths[o + 3], packs.get(o + 3)));
}

// Every layer of a pass: x [B, Q, H]; ws holds six weights a layer (input norm, qkv, o, post norm, gate-up,
// down), bs, packs and paths four a layer (qkv, o, gate-up, down; target_step.PATHS); cos and sin_signed
// [B, 1, Q, d]; keys and values the rows' buffers, written as one span from `start`, or each token at its
// position in write [B, Q] (rows of unequal lengths).
at::Tensor fused_pass(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                      const std::optional<at::Tensor>& mask, const c10::List<at::Tensor>& ws, const Biases& bs,
                      const Biases& packs, at::IntArrayRef paths, const c10::List<at::Tensor>& keys,
                      const c10::List<at::Tensor>& values, int64_t start, int64_t kv_len, at::IntArrayRef nq,
                      at::IntArrayRef nk, int64_t d, double eps, double scaling,
                      const std::optional<at::Tensor>& write) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3, "fused_pass takes float32 [B, Q, H]");
  const int64_t layers = static_cast<int64_t>(nq.size());
  TORCH_CHECK(ws.size() == 6 * layers && bs.size() == 4 * layers && packs.size() == 4 * layers &&
              static_cast<int64_t>(paths.size()) == 4 * layers && keys.size() == layers && values.size() == layers,
              "fused_pass: six weights and four biases, packs and paths a layer");
  for (int64_t i = 0; i < layers; ++i) {
    for (int64_t j : {i * 6, i * 6 + 3}) {
      TORCH_CHECK(ws.get(j).scalar_type() == at::kFloat && ws.get(j).is_contiguous() && ws.get(j).numel() == x.size(-1),
                  "each norm weight must be one contiguous float32 row");
    }
    TORCH_CHECK(keys.get(i).scalar_type() == at::kFloat && values.get(i).scalar_type() == at::kFloat &&
                keys.get(i).size(0) == x.size(0), "the rows' KV buffers must be float32");
  }
  const at::Tensor c = cos.contiguous(), s = sin_signed.contiguous();
  TORCH_CHECK(c.numel() == x.size(0) * x.size(1) * d && s.numel() == c.numel(),
              "cos and sin must hold each token's position");
  at::Tensor at_pos;
  if (write.has_value() && write->defined()) {
    at_pos = write->to(at::kLong).contiguous();
    TORCH_CHECK(at_pos.numel() == x.size(0) * x.size(1), "write must hold each token's cache position");
    const int64_t* wp = at_pos.data_ptr<int64_t>();
    for (int64_t i = 0; i < at_pos.numel(); ++i) {
      for (int64_t l = 0; l < layers; ++l) {
        TORCH_CHECK(wp[i] >= 0 && wp[i] < keys.get(l).size(2) && wp[i] < values.get(l).size(2),
                    "a write position lies outside the KV buffers");
      }
    }
  }
  std::vector<starjar_native::Chunk> chunks = starjar_native::key_chunks(mask, x.size(1), kv_len);
  if (chunks.size() > 1) {  // each chunk's rows of the mask (key_chunks splits only a masked pass), for every layer
    const at::Tensor& m = *mask;
    const int64_t Q = x.size(1), g = m.size(2) / Q;
    TORCH_CHECK(m.size(2) == g * Q, "fused_pass: the mask holds each query's row, folded per group of heads");
    for (starjar_native::Chunk& c : chunks) {  // the folded mask's rows r Q + t, for t in the chunk
      const int64_t rows = c.m1 - c.m0;
      c.mask = m.reshape({m.size(0), m.size(1), g, Q, m.size(3)}).narrow(3, c.m0, rows).narrow(4, 0, c.keys)
                   .reshape({m.size(0), m.size(1), g * rows, c.keys});
    }
  }
  const Pass p{&chunks, start, kv_len, d, eps, scaling, c.data_ptr<float>(), s.data_ptr<float>(),
               at_pos.defined() ? at_pos.data_ptr<int64_t>() : nullptr};
  at::Tensor out = x;
  for (int64_t i = 0; i < layers; ++i) {
    out = layer(out, p, mask, ws, bs, packs, paths, i, keys.get(i), values.get(i), nq[i], nk[i]);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(starjar, m) {
  m.def("fused_pass(Tensor x, Tensor cos, Tensor sin_signed, Tensor? mask, Tensor[] ws, Tensor?[] bs, "
        "Tensor?[] packs, int[] paths, Tensor[] keys, Tensor[] values, int start, int kv_len, int[] nq, int[] nk, "
        "int d, float eps, float scaling, Tensor? write=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) { m.impl("fused_pass", fused_pass); }
// MKL's packed weights are MkldnnCPU tensors: a pass that takes them dispatches there.
TORCH_LIBRARY_IMPL(starjar, MkldnnCPU, m) { m.impl("fused_pass", fused_pass); }
