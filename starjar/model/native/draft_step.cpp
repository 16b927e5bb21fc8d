// An int8 Llama-family draft's one-row one-token step (every layer) as one native call.
//
// The scripted step (starjar/model/lean_step.py, _layer) runs about 35 small ops a layer from the TorchScript
// interpreter; its four int8 products are near the memory floor, the glue is the rest (on a 2-core Xeon, 5 ms
// of products in a 13 ms step). Here the products are torch's dynamic int8 kernel (the packed weights' own
// apply_dynamic, which quantized::linear_dynamic calls), attention and SiLU are ATen's, RMSNorm's sum is ATen's,
// and the elementwise work between them is written out in the scripted step's order and rounding: the hidden
// states are the scripted step's bit for bit (tests/starjar/test_native_draft.py).
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include "elementwise.h"

#include <vector>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;
using starjar_native::residual;
using starjar_native::rms_norm;

// The packed weights inside a TorchScript object (a custom class holds its C++ object in slot 0).
Packed unpack(const c10::IValue& v) {
  TORCH_CHECK(v.isObject(), "draft_step takes LinearPackedParamsBase objects");
  return c10::static_intrusive_pointer_cast<LinearPackedParamsBase>(v.toObject()->getSlot(0).toCapsule());
}

struct Step {
  int64_t start, d;
  double eps;
  bool reduce_range;
  const float* cos;  // [d]: the token's position
  const float* sin;
};

// One layer of lean_step._layer over x [1, 1, H]; keys and values [1, nk, L, d], written at `start`.
at::Tensor layer(const at::Tensor& x, const Step& s, const at::Tensor& w_in, const at::Tensor& w_post,
                 const Packed* packs, const at::Tensor& keys, const at::Tensor& values, int64_t nq, int64_t nk) {
  const int64_t d = s.d, half = d / 2;
  const at::Tensor heads = packs[0]->apply_dynamic(rms_norm(x, w_in, s.eps), s.reduce_range);
  const float* hp = heads.data_ptr<float>();
  // q and k rotated (rotate_half: the second half negated first), q folded [1, nk, g, d] as the scripted step
  // lays the group's query heads along its KV head's query axis: that is q's own head order.
  at::Tensor query = at::empty({1, nk, nq / nk, d}, x.options());
  float* qp = query.data_ptr<float>();
  const auto ks = keys.strides();
  const auto vs = values.strides();
  float* kp = keys.data_ptr<float>() + s.start * ks[2];
  float* vp = values.data_ptr<float>() + s.start * vs[2];
  for (int64_t j = 0; j < nq + nk; ++j) {
    const float* src = hp + j * d;
    float* dst = j < nq ? qp + j * d : nullptr;
    for (int64_t e = 0; e < d; ++e) {
      const float a = src[e] * s.cos[e];
      const float r = (e < half ? -src[e + half] : src[e - half]) * s.sin[e];
      if (dst != nullptr) {
        dst[e] = a + r;
      } else {
        kp[(j - nq) * ks[1] + e * ks[3]] = a + r;
      }
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    const float* src = hp + (nq + nk + j) * d;
    for (int64_t e = 0; e < d; ++e) vp[j * vs[1] + e * vs[3]] = src[e];
  }
  const at::Tensor k_att = keys.narrow(2, 0, s.start + 1), v_att = values.narrow(2, 0, s.start + 1);
  const bool flash = at::globalContext().userEnabledFlashSDP() && k_att.stride(-1) == 1 && v_att.stride(-1) == 1;
  const at::Tensor att = flash
      ? std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(query, k_att, v_att, 0.0, false, {}, {}))
      : at::scaled_dot_product_attention(query, k_att, v_att, {}, 0.0, false, {});
  const at::Tensor y = residual(x, packs[1]->apply_dynamic(att.reshape({1, 1, nq * d}), s.reduce_range));
  const at::Tensor gate_up = packs[2]->apply_dynamic(rms_norm(y, w_post, s.eps), s.reduce_range);
  const int64_t inner = gate_up.size(-1) / 2;
  const at::Tensor act = at::silu(gate_up.narrow(-1, 0, inner));
  at::Tensor prod = at::empty_like(act);
  const float* ap = act.data_ptr<float>();
  const float* up = gate_up.data_ptr<float>() + inner;
  float* pp = prod.data_ptr<float>();
  for (int64_t e = 0; e < inner; ++e) pp[e] = ap[e] * up[e];
  return residual(y, packs[3]->apply_dynamic(prod, s.reduce_range));
}

// Every layer of a one-token step: x [1, 1, H]; norms two a layer (input, post-attention); packs four a layer
// (qkv, o, gate-up, down), all with one reduce_range; cos and sin [1, 1, 1, d]; keys and values the row's
// buffers [1, nk, L, d], written at `start`.
void draft_step(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 13);
  const at::Tensor x = args[0].toTensor(), cos = args[1].toTensor().contiguous(),
                   sin = args[2].toTensor().contiguous();
  const auto norms = args[3].toTensorList();
  const auto pack_list = args[4].toList();
  const bool reduce_range = args[5].toBool();
  const auto keys = args[6].toTensorList(), values = args[7].toTensorList();
  const int64_t start = args[8].toInt();
  const auto nq = args[9].toIntVector(), nk = args[10].toIntVector();
  const int64_t layers = static_cast<int64_t>(nq.size());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == x.size(-1),
              "draft_step takes one float32 row [1, 1, H]");
  TORCH_CHECK(norms.size() == 2 * layers && pack_list.size() == 4 * layers && keys.size() == layers &&
              values.size() == layers && nk.size() == nq.size(), "draft_step: two norms and four packs a layer");
  const int64_t d = args[11].toInt();
  TORCH_CHECK(cos.numel() == d && sin.numel() == d, "cos and sin must hold the token's position");
  std::vector<Packed> packs;
  packs.reserve(pack_list.size());
  for (const c10::IValue& v : pack_list) packs.push_back(unpack(v));
  for (int64_t i = 0; i < layers; ++i) {
    TORCH_CHECK(keys.get(i).scalar_type() == at::kFloat && values.get(i).scalar_type() == at::kFloat &&
                start < keys.get(i).size(2), "the row's KV buffers must be float32 with room at start");
  }
  const double eps = args[12].toDouble();
  const Step s{start, d, eps, reduce_range, cos.data_ptr<float>(), sin.data_ptr<float>()};
  at::Tensor out = x;
  for (int64_t i = 0; i < layers; ++i) {
    out = layer(out, s, norms.get(2 * i), norms.get(2 * i + 1), packs.data() + 4 * i, keys.get(i), values.get(i),
                nq[i], nk[i]);
  }
  torch::jit::drop(*stack, 13);
  torch::jit::push(*stack, std::move(out));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(starjar, m) {
  m.def("draft_step(Tensor x, Tensor cos, Tensor sin, Tensor[] norms, "
        "__torch__.torch.classes.quantized.LinearPackedParamsBase[] packs, bool reduce_range, Tensor[] keys, "
        "Tensor[] values, int start, int[] nq, int[] nk, int d, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(starjar, CPU, m) {
  m.impl("draft_step", torch::CppFunction::makeFromBoxedFunction<&draft_step>());
}
