"""A lean forward for Llama-family drafts: the same layers, a third of the calls.

At batch 1 a draft step of the default pair is 30 layers of small ops: on a 2-core CPU about half of its
time went to calling them (Hugging Face's module tree, seven int8 linears per layer each with a fixed cost
of about 80 us in fbgemm, five ops per RMSNorm). This forward runs the same weights with q/k/v fused into
one int8 linear, gate/up into another, RMSNorm spelled out (lean_step.rms_norm), and the folded attention of
starjar.model.attention, over starjar's ragged KV cache.

It is used for drafts only (proposals may differ in the last bits; verification decides), never for a
target, whose output must stay Hugging Face's own. Models it does not know (GPT-2, ...) keep the HF path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from starjar.cpu import kernels
from starjar.model import lean_step
from starjar.model.attention import fold_mask, folded_attention
from starjar.model.kv_cache import RaggedKVCache
from starjar.model.lean_step import rms_norm
from starjar.model.native_draft import CONTEXT, NativeDraftPass

FAMILIES = ("llama", "qwen2", "mistral")


class LeanDecoder(torch.nn.Module):
    """Wraps a Llama-family CausalLM whose linears are starjar int8 linears (or plain nn.Linear)."""

    def __init__(self, model: torch.nn.Module, fuse: bool = True, skip: tuple[int, ...] = ()):
        """skip: decoder layers this draft leaves out (self-speculation: a cheaper, less faithful copy; the
        draft's KV cache holds only the layers it runs)."""
        super().__init__()
        self.model = model
        self.head = getattr(model, "starjar_head", None)  # see attach_fused
        base = model.base_model
        cfg = model.config
        self.eps = cfg.rms_norm_eps
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # What a step reads per layer, looked up once (module attribute lookups cost ~0.5 ms a step).
        self.plan = []
        self.skipped = tuple(sorted(set(skip)))
        for i, layer in enumerate(base.layers):
            if i in self.skipped:
                continue
            att, mlp = layer.self_attn, layer.mlp
            qkv = getattr(att, "starjar_qkv", None) if fuse else None
            gate_up = getattr(mlp, "starjar_gate_up", None) if fuse else None
            nq, nk = att.q_proj.out_features // self.head_dim, att.k_proj.out_features // self.head_dim
            self.plan.append((layer.input_layernorm.weight, qkv, att, nq, nk, att.o_proj,
                              layer.post_attention_layernorm.weight, gate_up, mlp, mlp.down_proj))
        self.final_norm = base.norm.weight
        # The scripted one-token step (starjar.model.lean_step) needs every layer's four linears in torch's int8 kernel,
        # all with one reduce_range (it passes one); compiled here so the first served step does not pay for it.
        linears = [lin for p in self.plan for lin in (p[1], p[5], p[7], p[9])]
        self.scriptable = all(hasattr(lin, "_packed") for lin in linears) and \
            len({lin._reduce_range for lin in linears}) == 1
        # Per layer, the float biases of those four (RowInt8Linear keeps them beside its packed weights), and their
        # int_mm weights and scales where that is their multi-row path (None on the fused one; a linear's path is
        # fixed when it is quantized).
        self._biases = [[p[i].bias for i in (1, 5, 7, 9)] for p in self.plan] if self.scriptable else []
        self._mats = [[m for i in (1, 5, 7, 9) for m in (p[i].w_t, p[i].w_scale)] for p in self.plan] \
            if self.scriptable else []
        # int_mm's generic kernel (STARJAR_INT_MM_ONEDNN=0) is chosen per call, so its passes stay eager.
        self.rows_fused = self.scriptable and all(lin.path == "fused" for lin in linears)
        self.native = self._native_pass()
        if self.scriptable and lean_step.enabled():
            lean_step.layer_fn()
            lean_step.rows_layer_fn()
            self.native.settle(self._probe)

    def leave_out(self, skip: tuple[int, ...]) -> None:
        """Run without these decoder layers from now on (indices of the whole model; () runs them all). A cache
        filled before is not valid after: its layers are the plan's."""
        if not hasattr(self, "_whole"):
            self._whole = (list(self.plan), list(self._biases), list(self._mats), self.skipped)
        plan, biases, mats, skipped = self._whole
        kept = [i for i in range(len(plan) + len(skipped)) if i not in skipped]
        self.skipped = tuple(sorted(set(skip) | set(skipped)))
        self.plan = [p for i, p in zip(kept, plan, strict=True) if i not in skip]
        self._biases = [b for i, b in zip(kept, biases, strict=True) if i not in skip] if biases else []
        self._mats = [m for i, m in zip(kept, mats, strict=True) if i not in skip] if mats else []
        chosen = self.native.chosen  # the same kernels over fewer layers: the choice stands
        self.native = self._native_pass()
        self.native.chosen = chosen

    def _native_pass(self) -> NativeDraftPass:
        return NativeDraftPass(self.plan if self.scriptable else [], self._biases, self.head_dim, self.eps,
                               self.rows_fused)

    @staticmethod
    def attach_fused(model: torch.nn.Module, head_vocab: int | None = None) -> None:
        """Before quantization: q/k/v and gate/up as one float linear each (quantized with the rest, so their
        int8 weights and per-channel scales are exactly those of the separate layers). The separate layers
        stay for Hugging Face's own forward (assisted generation uses it).

        head_vocab: a head over the first head_vocab ids only (a BPE vocabulary's ids run roughly from
        frequent to rare): tokens past it are never proposed, which verification makes harmless."""
        if head_vocab:
            head = model.get_output_embeddings()
            model.starjar_head = torch.nn.Linear(head.in_features, min(head_vocab, head.out_features), bias=False)
            with torch.no_grad():
                model.starjar_head.weight.copy_(head.weight[: model.starjar_head.out_features])
        for layer in model.base_model.layers:
            att, mlp = layer.self_attn, layer.mlp
            att.starjar_qkv = _concat([att.q_proj, att.k_proj, att.v_proj])
            mlp.starjar_gate_up = _concat([mlp.gate_proj, mlp.up_proj])

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        cfg = getattr(model, "config", None)
        return getattr(cfg, "model_type", None) in FAMILIES and getattr(cfg, "hidden_act", "silu") == "silu"

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache,
               counts: list[int] | None = None) -> torch.Tensor:
        """input_ids [B, Q] -> last hidden states [B, Q, hidden] (normed), writing K/V into `cache`.
        counts: each row's real tokens (the rest of its Q is padding), when known.

        A ragged pass (a catch-up beside one-token steps) runs its int8 linears, norms and MLP on its real tokens
        only; only attention sees the padded layout. Padded, an 8-row pass with one 5-token catch-up cost as much
        as eight of them (default pair's draft, 35 ms vs 25 ms ragged; 19 ms for eight one-token rows)."""
        base = self.model.base_model
        x = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(x, position_ids)  # [B, Q, D]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, Q, 1, D]: broadcast over heads
        b, q = input_ids.shape
        real = _real_tokens(counts, q) if counts is not None and b > 1 else None
        if real is not None:  # x, cos and sin as [T, 1, ...]: the real tokens only
            x, cos, sin = (t.reshape(b * q, 1, *t.shape[2:]).index_select(0, real) for t in (x, cos, sin))
        views = None
        if self.scriptable and lean_step.enabled() and (b == 1 and q == 1 or self.rows_fused
                                                         or kernels.int_mm_uses_onednn()):
            views = cache.pass_views(len(self.plan), trees=True)  # a tree pass attends with its mask below
        if views is not None:
            x = self._scripted_layers(x, cos, sin, mask, *views, real=real, padded=(b, q), tree=cache.tree_pass)
        else:
            x = self._eager_layers(x, cos, sin, mask, cache, real, b, q)
        x = rms_norm(x, self.final_norm, self.eps)
        if real is None:
            return x
        full = torch.zeros(b * q, x.shape[-1], dtype=x.dtype, device=x.device)
        return full.index_copy_(0, real, x.view(real.shape[0], -1)).view(b, q, -1)

    def _eager_layers(self, x, cos, sin, mask, cache, real: torch.Tensor | None, b: int, q: int) -> torch.Tensor:
        """Every layer op by op (the multi-row path where the scripted one does not apply); real: as
        _scripted_layers'."""
        d, eps = self.head_dim, self.eps
        for i, (w_in, qkv, att, nq, nk, o_proj, w_post, gate_up, mlp, down) in enumerate(self.plan):
            h = rms_norm(x, w_in, eps)
            if qkv is not None:  # [B, Q, heads q+k+v, D]; q and k rotated in one go
                heads = qkv(h)
            else:
                heads = torch.cat([att.q_proj(h), att.k_proj(h), att.v_proj(h)], -1)
            heads = heads.view(*x.shape[:2], -1, d)
            qk = rope(heads[:, :, : nq + nk], cos, sin)
            qs, ks, vs = qk[:, :, :nq], qk[:, :, nq:], heads[:, :, nq + nk:]
            if real is not None:
                qs, ks, vs = (lean_step.padded(t, real, b, q) for t in (qs, ks, vs))
            ks, vs = cache.update(ks.transpose(1, 2), vs.transpose(1, 2), i)  # in the cache's precision
            a, _ = folded_attention(att, qs.transpose(1, 2).to(ks.dtype), ks, vs, mask)
            a = a.to(x.dtype).reshape(b, q, -1)
            x = x + o_proj(a if real is None else a.reshape(b * q, 1, -1).index_select(0, real))
            h = rms_norm(x, w_post, eps)
            if gate_up is not None:
                gate, up = gate_up(h).chunk(2, dim=-1)
            else:
                gate, up = mlp.gate_proj(h), mlp.up_proj(h)
            x = x + down(F.silu(gate) * up)
        return x

    def _scripted_layers(self, x, cos, sin, mask, keys, values, rows, write, start: int, kv_len: int,
                         real: torch.Tensor | None, padded: tuple[int, int], tree: bool = False) -> torch.Tensor:
        """A pass through every layer as starjar.model.lean_step's scripted layer: the one-row one-token step, or the
        multi-row layer (several rows, or a catch-up's several tokens). real: a ragged pass's real tokens (x, cos
        and sin hold only those), or None; padded: the pass's (B, Q); tree: the pass has token-tree rows, whose
        tokens see only the keys the mask leaves them (a one-token tree pass too: a fanout branch's), so every
        layer attends with it."""
        b, q = padded
        d, eps = self.head_dim, self.eps
        if rows is None and self.native.takes(x, keys, self._probe):
            return self.native.run(x, cos, sin, mask, keys, values, write, start, kv_len, real, padded, tree=tree)
        if b == 1 and q == 1 and rows is None and write is None and not tree:
            layer = lean_step.layer_fn()
            for (w_in, qkv, _, nq, nk, o_proj, w_post, gate_up, _, down), k, v in zip(self.plan, keys, values,
                                                                                         strict=True):
                x = layer(x, cos, sin, w_in, qkv._packed, o_proj._packed, w_post, gate_up._packed, down._packed,
                          qkv._reduce_range, k, v, start, nq, nk, d, eps)
            return x
        layer = lean_step.rows_layer_fn()
        folded = {}  # the mask folded per group size once per pass, as starjar.model.attention does
        for (w_in, qkv, _, nq, nk, o_proj, w_post, gate_up, _, down), k, v, biases, mats in zip(
                self.plan, keys, values, self._biases, self._mats, strict=True):
            g = nq // nk
            if g not in folded:
                folded[g] = mask if q == 1 else fold_mask(mask, g)
            x = layer(x, cos, sin, w_in, qkv._packed, o_proj._packed, w_post, gate_up._packed, down._packed,
                      qkv._reduce_range, k, v, rows, write, start, kv_len, folded[g], nq, nk, d, eps, biases,
                      mats, real, b, q)
        return x

    def _probe(self, b: int, q: int, native: bool):
        """A function running passes of b rows x q tokens after CONTEXT positions, in its own float32 cache,
        natively or scripted (NativeDraftPass's measurement)."""
        cache = RaggedKVCache(self.final_norm.device, torch.float32)
        slots = [cache.allocate() for _ in range(b)]

        def run(n: int) -> None:
            for s in slots:
                cache.truncate(s, min(cache.lengths[s], CONTEXT))
            pos, mask = cache.begin(slots, [n] * b)
            self.native.override = native if n == q else False
            try:
                self.hidden(torch.full((b, n), 7, dtype=torch.long), pos, mask, cache)
            finally:
                self.native.override = None

        run(CONTEXT)
        return lambda: run(q)


def _real_tokens(counts: list[int], q: int) -> torch.Tensor | None:
    """The flat indices (in B x Q) of a pass's real tokens, or None when no row is padded."""
    if sum(counts) == len(counts) * q:
        return None
    return torch.tensor([b * q + i for b, n in enumerate(counts) for i in range(n)], dtype=torch.long)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for one tensor. x [B, Q, H, D] and cos, sin [B, Q, 1, D] here; any shapes that
    broadcast so. (A torch.roll formulation disagreed with Hugging Face's on
    ragged passes; the rotation is spelled out as HF's rotate_half.)"""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _concat(linears: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One float linear whose output is the given linears' outputs side by side (they share an input)."""
    has_bias = any(lin.bias is not None for lin in linears)
    fused = torch.nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears), bias=has_bias)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if has_bias:
            fused.bias.copy_(torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.out_features)
                                        for lin in linears]))
    return fused
