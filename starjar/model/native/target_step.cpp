// A float32 Llama-family target's one-row, one-token step over every layer, as one native call.
//
// The scripted step (starjar/model/target_step.py, _fused_step) dispatches about 45 small ops per layer from
// the TorchScript interpreter; on 2 cores that glue cost 6-9 ms of a 35 ms step. Here every sum is ATen's own
// (the products, RMSNorm's mean, attention, SiLU), called with the shapes the scripted step gives them, and
// only the elementwise work between them is written out, each value rounded as ATen rounds it (built with
// -ffp-contract=off, so no product and sum fuse into one rounding). The result is the scripted step's, bit
// for bit (tests/starjar/test_native_step.py checks that on the running machine; starjar/model/native_step.py
// builds and loads it).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

// LlamaRMSNorm of one row. Its mean of squares is ATen's mean: the squares (pow 2 is x * x) summed by ATen's
// own reduction, then divided by the count (mean is sum, then div_); then x * rsqrt(var + eps) and the weight,
// elementwise, in HF's order. (pow and mean as ATen calls cost 32 us a norm; this, 6.)
at::Tensor rms_norm_row(const at::Tensor& x, const at::Tensor& w, double eps) {
  const float* xp = x.data_ptr<float>();
  const int64_t n = x.numel();
  at::Tensor sq = at::empty_like(x);
  float* sp = sq.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) sp[i] = xp[i] * xp[i];
  const float var = at::sum(sq, {-1}, true).data_ptr<float>()[0] / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(var + static_cast<float>(eps));
  at::Tensor out = at::empty_like(x);
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float h = xp[i] * r;
    op[i] = wp[i] * h;
  }
  return out;
}

// x + y into a new tensor (the residual), as the scripted `x + ...`.
at::Tensor add_rows(const at::Tensor& x, const at::Tensor& y) {
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) op[i] = xp[i] + yp[i];
  return out;
}

// F.linear of one row, as at::linear computes it for a contiguous [1, 1, K] input: addmm with the bias, else mm
// over the [1, K] view (at::matmul folds the input so); called directly, without linear's and matmul's glue.
at::Tensor product(const at::Tensor& x, const at::Tensor& w, const c10::List<std::optional<at::Tensor>>& bs,
                   int64_t i) {
  const at::Tensor row = x.view({1, x.numel()});
  const std::optional<at::Tensor> b = bs.get(i);
  return b.has_value() && b->defined() ? at::addmm(*b, row, w.t()) : at::mm(row, w.t());
}

// One layer: heads [1, 1, (nq + 2 nk) d] from the qkv product; q and k rotated (rotate_half with its sign in
// sin_signed), k and v written at `start` of the layer's buffers [1, nk, L, d], attention over kv_len keys.
at::Tensor layer(const at::Tensor& x, const float* cos, const float* sin_signed, const std::optional<at::Tensor>& mask,
                 const c10::List<at::Tensor>& ws, const c10::List<std::optional<at::Tensor>>& bs, int64_t base,
                 const at::Tensor& keys, const at::Tensor& values, int64_t start, int64_t kv_len, int64_t nq,
                 int64_t nk, int64_t d, double eps, double scaling) {
  const int64_t w = base * 6, b = base * 4;
  at::Tensor h = rms_norm_row(x, ws.get(w), eps);
  at::Tensor heads = product(h, ws.get(w + 1), bs, b);
  const float* hp = heads.data_ptr<float>();
  at::Tensor rot = at::empty({1, nq + nk, 1, d}, x.options());
  float* rp = rot.data_ptr<float>();
  const int64_t half = d / 2;
  for (int64_t j = 0; j < nq + nk; ++j) {
    const float* src = hp + j * d;
    float* dst = rp + j * d;
    for (int64_t i = 0; i < d; ++i) {
      const float a = src[i] * cos[i];
      const float c = src[i < half ? i + half : i - half] * sin_signed[i];
      dst[i] = a + c;
    }
  }
  const auto ks = keys.strides();
  const auto vs = values.strides();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  for (int64_t j = 0; j < nk; ++j) {
    float* kd = kp + j * ks[1] + start * ks[2];
    float* vd = vp + j * vs[1] + start * vs[2];
    const float* kr = rp + (nq + j) * d;
    const float* vr = hp + (nq + nk + j) * d;
    for (int64_t i = 0; i < d; ++i) {
      kd[i * ks[3]] = kr[i];
      vd[i * vs[3]] = vr[i];
    }
  }
  at::Tensor query = rot.narrow(1, 0, nq);
  const int64_t g = nq / nk;
  if (g != 1) query = query.reshape({1, nk, g, d});
  at::Tensor att = at::scaled_dot_product_attention(query, keys.narrow(2, 0, kv_len), values.narrow(2, 0, kv_len),
                                                    mask, 0.0, false, scaling);
  if (g != 1) att = att.reshape({1, nq, 1, d});
  att = att.transpose(1, 2).contiguous();
  at::Tensor y = add_rows(x, product(att, ws.get(w + 2), bs, b + 1));
  h = rms_norm_row(y, ws.get(w + 3), eps);
  at::Tensor gate_up = product(h, ws.get(w + 4), bs, b + 2);
  const int64_t inner = gate_up.size(-1) / 2;
  at::Tensor act = at::silu(gate_up.narrow(-1, 0, inner));
  at::Tensor prod = at::empty_like(act);
  const float* ap = act.data_ptr<float>();
  const float* up = gate_up.data_ptr<float>() + inner;
  float* pp = prod.data_ptr<float>();
  for (int64_t i = 0; i < inner; ++i) pp[i] = ap[i] * up[i];
  return add_rows(y, product(prod, ws.get(w + 5), bs, b + 3));
}

// Every layer's step: ws holds six weights a layer (input norm, qkv, o, post norm, gate-up, down) and bs four
// biases (qkv, o, gate-up, down); cos and sin_signed are [.., d] for the one position.
at::Tensor fused_step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                      const std::optional<at::Tensor>& mask, const c10::List<at::Tensor>& ws,
                      const c10::List<std::optional<at::Tensor>>& bs, const c10::List<at::Tensor>& keys,
                      const c10::List<at::Tensor>& values, int64_t start, int64_t kv_len, at::IntArrayRef nq,
                      at::IntArrayRef nk, int64_t d, double eps, double scaling) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == x.size(-1),
              "fused_step takes one contiguous float32 row");
  for (int64_t i = 0; i < static_cast<int64_t>(nq.size()); ++i) {
    for (int64_t j : {i * 6, i * 6 + 3}) {
      TORCH_CHECK(ws.get(j).scalar_type() == at::kFloat && ws.get(j).is_contiguous() && ws.get(j).numel() == x.numel(),
                  "each norm weight must be one contiguous float32 row");
    }
    TORCH_CHECK(keys.get(i).scalar_type() == at::kFloat && values.get(i).scalar_type() == at::kFloat,
                "the KV buffers must be float32");
  }
  at::Tensor c = cos.contiguous(), s = sin_signed.contiguous();
  TORCH_CHECK(c.numel() == d && s.numel() == d, "cos and sin must hold one position of head_dim values");
  at::Tensor out = x;
  for (int64_t i = 0; i < static_cast<int64_t>(nq.size()); ++i) {
    out = layer(out, c.data_ptr<float>(), s.data_ptr<float>(), mask, ws, bs, i, keys.get(i), values.get(i), start,
                kv_len, nq[i], nk[i], d, eps, scaling);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(starjar, m) {
  m.def("fused_step(Tensor x, Tensor cos, Tensor sin_signed, Tensor? mask, Tensor[] ws, Tensor?[] bs, "
        "Tensor[] keys, Tensor[] values, int start, int kv_len, int[] nq, int[] nk, int d, float eps, "
        "float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) { m.impl("fused_step", fused_step); }
