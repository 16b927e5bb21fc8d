// An int8 Llama-family draft's pass over rows on consecutive cache slots (a one-token step, a catch-up of a
// few tokens, batched drafting), every layer, as one native call.
//
// The scripted layers (starjar/model/lean_step.py) run about 35 small ops a layer from the TorchScript
// interpreter; their four int8 products are near the memory floor, the glue is the rest (on a 2-core Xeon,
// 5 ms of products in a 13 ms one-token step). Here the products are torch's dynamic int8 kernel (the packed
// weights' own apply_dynamic, which quantized::linear_dynamic calls) with lean_step's row scaling, RMSNorm's
// sum, attention and SiLU are ATen's, and the elementwise work is written out in lean_step's order and rounding:
// the hidden states are the scripted layers' bit for bit (tests/starjar/test_native_draft.py).
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include "pass_parts.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;
using starjar_native::flash_applies;
using starjar_native::residual;
using starjar_native::rms_norm;

// The packed weights inside a TorchScript object (a custom class holds its C++ object in slot 0).
Packed unpack(const c10::IValue& v) {
  TORCH_CHECK(v.isObject(), "draft_pass takes LinearPackedParamsBase objects");
  return c10::static_intrusive_pointer_cast<LinearPackedParamsBase>(v.toObject()->getSlot(0).toCapsule());
}

struct Pass {
  int64_t start, kv_len, d;
  double eps;
  bool reduce_range;
  const float* cos;  // [B, Q, d]: each token's position
  const float* sin;
  std::optional<at::Tensor> mask;  // [B, 1, g Q, L] additive, folded for grouped heads (a one-token step: none,
                                   // unless a token tree's row hides keys from it)
  const int64_t* write;  // [B, Q]: each token's cache position, or null: one span from `start`
  // A padded pass (rows of unequal token counts): the real tokens' indices in the flattened [B, Q], x holding
  // those alone; only attention sees the padded layout (lean_step._rows_layer). Null: x is [B, Q, H] itself.
  const at::Tensor* real;
  int64_t rows, span;  // the padded pass's B and Q (with real)
};

// A product by packed int8 weights, as lean_step runs it: one token as torch's dynamic kernel is (its one
// activation range is the row's own); several with each row scaled to an absolute maximum of 1 first and put
// right after, the bias (inside the packed weights) scaled with the row and restored (lean_step._rows_linear).
// A product's weights: torch's packed int8 ones, and where starjar's own int8 product was chosen
// (starjar.cpu.few_rows) their layout for it: int8 [N, K padded] and [2, N] scales and weight sums.
struct Weights {
  Packed pack;
  at::Tensor own_w, own_meta;
};

// starjar's own int8 product: x quantized per row, VNNI sums (starjar/cpu/native/int8_rows.cpp).
at::Tensor own_product(const at::Tensor& x, const Weights& w, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("starjar::int8_rows", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  const int64_t k = x.size(-1), rows = x.numel() / k;
  at::Tensor y = op.call(x.reshape({rows, k}), w.own_w, w.own_meta, bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.own_w.size(0);
  return y.view(shape);
}

at::Tensor product(const at::Tensor& x, const Weights& w, const std::optional<at::Tensor>& bias, bool reduce_range) {
  if (w.own_w.defined()) return own_product(x, w, bias);
  const Packed& pack = w.pack;
  const int64_t k = x.size(-1), rows = x.numel() / k;
  if (rows == 1) return pack->apply_dynamic(x, reduce_range);
  at::Tensor scaled = at::empty_like(x);
  std::vector<float> peaks(rows);
  const float* xp = x.data_ptr<float>();
  float* sp = scaled.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float peak = 0.0f;
    for (int64_t i = 0; i < k; ++i) peak = std::max(peak, std::fabs(xp[r * k + i]));
    peaks[r] = std::max(peak, 1e-12f);
    for (int64_t i = 0; i < k; ++i) sp[r * k + i] = xp[r * k + i] / peaks[r];
  }
  at::Tensor y = pack->apply_dynamic(scaled, reduce_range);
  float* yp = y.data_ptr<float>();
  const int64_t n = y.size(-1);
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      float& v = yp[r * n + i];
      v = bp == nullptr ? v * peaks[r] : (v - bp[i]) * peaks[r] + bp[i];
    }
  }
  return y;
}

// One layer of lean_step's over x [B, Q, H] (rows on consecutive slots), or a padded pass's real tokens
// [T, 1, H]; keys and values [B, nk, L, d], written from `start` or where `write` says; biases the four
// products' (undefined where none).
at::Tensor layer(const at::Tensor& x, const Pass& s, const at::Tensor& w_in, const at::Tensor& w_post,
                 const Weights* packs, const std::optional<at::Tensor>* biases, const at::Tensor& keys,
                 const at::Tensor& values, int64_t nq, int64_t nk) {
  const int64_t d = s.d, half = d / 2, heads_n = nq + 2 * nk, tokens = x.size(0) * x.size(1);
  const int64_t B = s.real != nullptr ? s.rows : x.size(0), Q = s.real != nullptr ? s.span : x.size(1);
  const int64_t* real = s.real != nullptr ? s.real->data_ptr<int64_t>() : nullptr;
  const at::Tensor heads = product(rms_norm(x, w_in, s.eps), packs[0], biases[0], s.reduce_range);
  const float* hp = heads.data_ptr<float>();
  // q and k rotated (rotate_half: the second half negated first); q laid [B, nq, Q, d], which is the
  // scripted layers' [B, nk, g Q, d]: a group's query heads along its KV head's query axis. A padded pass's
  // padding tokens have zero heads, as lean_step.padded lays them (their K and V land past their rows' valid
  // lengths, where no query looks).
  at::Tensor query = real != nullptr ? at::zeros({B, nq, Q, d}, x.options()) : at::empty({B, nq, Q, d}, x.options());
  float* qp = query.data_ptr<float>();
  const auto ks = keys.strides();
  const auto vs = values.strides();
  if (real != nullptr) {
    std::vector<bool> is_real(B * Q, false);
    for (int64_t r = 0; r < tokens; ++r) is_real[real[r]] = true;
    for (int64_t row = 0; row < B * Q; ++row) {
      if (is_real[row]) continue;
      const int64_t b = row / Q, pos = s.write != nullptr ? s.write[row] : s.start + row % Q;
      for (int64_t j = 0; j < nk; ++j) {
        for (int64_t e = 0; e < d; ++e) {
          keys.data_ptr<float>()[b * ks[0] + j * ks[1] + pos * ks[2] + e * ks[3]] = 0.0f;
          values.data_ptr<float>()[b * vs[0] + j * vs[1] + pos * vs[2] + e * vs[3]] = 0.0f;
        }
      }
    }
  }
  for (int64_t r = 0; r < tokens; ++r) {
    const int64_t row = real != nullptr ? real[r] : r, b = row / Q, t = row % Q;
    const int64_t pos = s.write != nullptr ? s.write[row] : s.start + t;
    const float* c = s.cos + r * d;
    const float* sn = s.sin + r * d;
    float* kp = keys.data_ptr<float>() + b * ks[0] + pos * ks[2];
    float* vp = values.data_ptr<float>() + b * vs[0] + pos * vs[2];
    for (int64_t j = 0; j < nq + nk; ++j) {
      const float* src = hp + (r * heads_n + j) * d;
      for (int64_t e = 0; e < d; ++e) {
        const float a = src[e] * c[e];
        const float rot = (e < half ? -src[e + half] : src[e - half]) * sn[e];
        if (j < nq) {
          qp[((b * nq + j) * Q + t) * d + e] = a + rot;
        } else {
          kp[(j - nq) * ks[1] + e * ks[3]] = a + rot;
        }
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      const float* src = hp + (r * heads_n + nq + nk + j) * d;
      for (int64_t e = 0; e < d; ++e) vp[j * vs[1] + e * vs[3]] = src[e];
    }
  }
  const at::Tensor folded = query.view({B, nk, nq / nk * Q, d});
  const at::Tensor k_att = keys.narrow(2, 0, s.kv_len), v_att = values.narrow(2, 0, s.kv_len);
  const at::Tensor scores = flash_applies(folded, k_att, v_att)
      ? std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(folded, k_att, v_att, 0.0, false, s.mask, {}))
      : at::scaled_dot_product_attention(folded, k_att, v_att, s.mask, 0.0, false, {});
  at::Tensor att = scores.view({B, nq, Q, d}).transpose(1, 2).contiguous().view({B, Q, nq * d});
  if (real != nullptr) att = att.view({B * Q, 1, nq * d}).index_select(0, *s.real);
  const at::Tensor y = residual(x, product(att, packs[1], biases[1], s.reduce_range));
  const at::Tensor gate_up = product(rms_norm(y, w_post, s.eps), packs[2], biases[2], s.reduce_range);
  const int64_t inner = gate_up.size(-1) / 2;
  at::Tensor prod = at::empty({x.size(0), x.size(1), inner}, x.options());
  const at::Tensor act = at::silu(gate_up.narrow(-1, 0, inner)).contiguous();
  const float* ap = act.data_ptr<float>();
  const float* gp = gate_up.data_ptr<float>();
  float* pp = prod.data_ptr<float>();
  for (int64_t r = 0; r < tokens; ++r) {
    for (int64_t e = 0; e < inner; ++e) pp[r * inner + e] = ap[r * inner + e] * gp[r * 2 * inner + inner + e];
  }
  return residual(y, product(prod, packs[3], biases[3], s.reduce_range));
}

// Every layer of a pass over B rows on consecutive cache slots, Q tokens each (a one-token step, a catch-up,
// batched drafting): x [B, Q, H]; mask as the scripted layers attend with it (folded for grouped heads when
// Q > 1; none for a one-token step); norms two a layer (input, post-attention); packs and biases four a layer
// (qkv, o, gate-up, down), all with one reduce_range; cos and sin [B, Q, 1, d]; keys and values the rows'
// buffers [B, nk, L, d], written from `start` or each token at its position in write [B, Q]; attention over
// the first kv_len positions. A padded pass (rows of unequal token counts): x, cos and sin hold its real tokens
// alone ([T, 1, ...]), real their indices in the flattened [rows, span], which attention and the cache see.
void draft_pass(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 22);
  const at::Tensor x = args[0].toTensor(), cos = args[1].toTensor().contiguous(),
                   sin = args[2].toTensor().contiguous();
  const std::optional<at::Tensor> mask = args[3].toOptional<at::Tensor>();
  const auto norms = args[4].toTensorList();
  const auto pack_list = args[5].toList();
  const auto bias_list = args[6].toOptionalTensorList();
  const bool reduce_range = args[7].toBool();
  const auto keys = args[8].toTensorList(), values = args[9].toTensorList();
  const int64_t start = args[10].toInt();
  const auto nq = args[11].toIntVector(), nk = args[12].toIntVector();
  const int64_t d = args[13].toInt(), layers = static_cast<int64_t>(nq.size());
  const double eps = args[14].toDouble();
  const int64_t kv_len = args[15].toInt();
  const std::optional<at::Tensor> write = args[16].toOptional<at::Tensor>();
  const std::optional<at::Tensor> real_arg = args[17].toOptional<at::Tensor>();
  const bool padded = real_arg.has_value() && real_arg->defined();
  const at::Tensor real = padded ? real_arg->to(at::kLong).contiguous() : at::Tensor();
  const int64_t B = padded ? args[18].toInt() : x.size(0), Q = padded ? args[19].toInt() : x.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3, "draft_pass takes float32 [B, Q, H]");
  TORCH_CHECK(norms.size() == 2 * layers && pack_list.size() == 4 * layers && bias_list.size() == 4 * layers &&
              keys.size() == layers && values.size() == layers && nk.size() == nq.size(),
              "draft_pass: two norms, four packs and four biases a layer");
  const int64_t tokens = x.size(0) * x.size(1);
  TORCH_CHECK(!padded || (x.size(1) == 1 && real.numel() == tokens && B > 0 && Q > 0),
              "draft_pass: a padded pass's x holds one real token a row, real their indices");
  for (int64_t i = 0; padded && i < tokens; ++i) {
    TORCH_CHECK(real.data_ptr<int64_t>()[i] >= 0 && real.data_ptr<int64_t>()[i] < B * Q &&
                (i == 0 || real.data_ptr<int64_t>()[i] > real.data_ptr<int64_t>()[i - 1]),
                "draft_pass: real must index the padded pass's tokens in order");
  }
  TORCH_CHECK(cos.numel() == tokens * d && sin.numel() == cos.numel(), "cos and sin must hold each position");
  TORCH_CHECK(tokens == 1 || mask.has_value(), "draft_pass: several rows or tokens need their mask");
  at::Tensor at_pos;
  if (write.has_value() && write->defined()) {
    at_pos = write->to(at::kLong).contiguous();
    TORCH_CHECK(at_pos.numel() == B * Q, "write must hold each token's cache position");
  }
  const int64_t* wp = at_pos.defined() ? at_pos.data_ptr<int64_t>() : nullptr;
  std::vector<Weights> packs;
  std::vector<std::optional<at::Tensor>> biases;
  for (const c10::IValue& v : pack_list) packs.push_back({unpack(v), at::Tensor(), at::Tensor()});
  if (!args[20].isNone()) {  // starjar's own int8 weights, four a layer
    const auto own_w = args[20].toTensorList(), own_meta = args[21].toTensorList();
    TORCH_CHECK(own_w.size() == 4 * layers && own_meta.size() == 4 * layers, "draft_pass: four own weights a layer");
    for (int64_t i = 0; i < 4 * layers; ++i) packs[i].own_w = own_w.get(i), packs[i].own_meta = own_meta.get(i);
  }
  for (int64_t i = 0; i < 4 * layers; ++i) biases.push_back(bias_list.get(i));
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor& k = keys.get(i);
    const at::Tensor& v = values.get(i);
    TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 4 &&
                v.dim() == 4 && k.size(0) == B && v.size(0) == B && kv_len <= k.size(2) &&
                kv_len <= v.size(2) && (wp != nullptr || start + Q <= k.size(2)),
                "the rows' KV buffers must be float32, one a row, with room for the pass");
  }
  for (int64_t i = 0; wp != nullptr && i < B * Q; ++i) {
    TORCH_CHECK(wp[i] >= 0 && wp[i] < keys.get(0).size(2), "a write position lies outside the KV buffers");
  }
  const Pass s{start, kv_len, d, eps, reduce_range, cos.data_ptr<float>(), sin.data_ptr<float>(),
               mask, wp, padded ? &real : nullptr, B, Q};
  at::Tensor out = x;
  for (int64_t i = 0; i < layers; ++i) {
    out = layer(out, s, norms.get(2 * i), norms.get(2 * i + 1), packs.data() + 4 * i, biases.data() + 4 * i,
                keys.get(i), values.get(i), nq[i], nk[i]);
  }
  torch::jit::drop(*stack, 22);
  torch::jit::push(*stack, std::move(out));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(starjar, m) {
  m.def("draft_pass(Tensor x, Tensor cos, Tensor sin, Tensor? mask, Tensor[] norms, "
        "__torch__.torch.classes.quantized.LinearPackedParamsBase[] packs, Tensor?[] biases, bool reduce_range, "
        "Tensor[] keys, Tensor[] values, int start, int[] nq, int[] nk, int d, float eps, int kv_len, "
        "Tensor? write, Tensor? real=None, int rows=0, int span=0, Tensor[]? own_w=None, Tensor[]? own_meta=None) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) {
  m.impl("draft_pass", torch::CppFunction::makeFromBoxedFunction<&draft_pass>());
}
