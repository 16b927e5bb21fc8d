"""The lean forward of a float Llama-family target (llama, qwen2, mistral): HF's layers without HF's Python.

HF's module tree runs about 50 small ops per layer, each paying Python, hooks and dispatch. Here each decoder
layer is one TorchScript function (starjar.model.target_step) computing every value HF's does with the same sums
on the same weights, writing K and V in place into the RaggedKVCache: the logits are HF's bit for bit. The
default target decoding alone (Intel Xeon, AVX512, 2 threads; benchmarks/probes/lean_target_speed.py): 22.2 ->
36.6 tokens/s at batch 1 (1.65x), 1.42x at batch 4, 1.45x at 8, 1.17x at 16, the same tokens either way.
Where the machine gives the same bits (starjar.model.fused_projections), q/k/v and gate/up are one product each;
passes over a row bucket take them fused or apart as measured, and fused passes over consecutive slots run
every layer in one native call where that measured faster (starjar.model.native_pass). Faster still, and not
HF's bits, is the whole lean pass (starjar.model.lean_pass: own products, norms and attention in one parallel
region), taken per class where it measured faster; greedy output stays HF generate()'s in the tests.

Pass shape classes (lean_choices.CLASSES): `step` (one row, one token: batch-1 decoding), `rows` (up to LONG
rows in all: verification over gamma + 1 positions, multi-row decoding) and `long` (prefill). Whether the lean
forward runs a class is measured once per machine and model shapes (starjar.model.lean_choices: both forwards
timed in turns on the model's own passes, a few seconds; kept in starjar.cpu.kernels' cache).
STARJAR_LEAN_TARGET=1 forces it wherever it applies, 0 forces HF's forward everywhere (tests force each).
Token-tree verification passes run it too: their tree is all in the pass's mask and position ids, which both
forwards take from RaggedKVCache.begin. Models outside the families, or
whose layers it does not reproduce (LeanTarget.supports), keep HF's forward.
"""

from __future__ import annotations

import logging

import torch

from starjar.cpu import few_rows, kernels, skinny_linear
from starjar.model import attention, fused_projections, lean_choices, lean_pass, native_pass, target_step
from starjar.model.kv_cache import RaggedKVCache
from starjar.model.rope_table import RopeTable

log = logging.getLogger(__name__)

ENV = "STARJAR_LEAN_TARGET"
FAMILIES = ("llama", "qwen2", "mistral")
LONG = 64  # rows (B x Q) past which a pass counts as long; skinny_linear's last bucket


def forced() -> bool | None:
    """What STARJAR_LEAN_TARGET forces: True (lean where it applies), False (HF's forward), None (measured)."""
    return kernels.forced_switch(ENV)


def shape_class(b: int, q: int) -> str:
    return "step" if b == 1 and q == 1 else "rows" if b * q <= LONG else "long"


class LeanTarget:
    """Runs a float Llama-family CausalLM's decoder over a RaggedKVCache as scripted layers."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.base = base = model.base_model
        layers = base.layers[: model.config.num_hidden_layers]
        att = layers[0].self_attn
        self.head_dim, self.scaling = att.head_dim, float(att.scaling)
        self.eps = float(layers[0].input_layernorm.variance_epsilon)
        self.kv_heads = att.k_proj.out_features // self.head_dim
        # One-row steps run every layer in one call over fused q/k/v and gate/up weights where that gives
        # the same bits here (the modules' weights become views of them first, so the plan below sees those);
        # where it does not (self.exact False), they are copies that only the whole lean pass reads, kept only
        # where it is taken (settle).
        fusion = fused_projections.fuse(layers)
        fused, self.exact = (None, False) if fusion is None else fusion
        # Per layer, looked up once: weights (norm, q, k, v, o, norm, gate, up, down), the seven linears and
        # their biases, and the head counts.
        self.plan = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
            ws = [layer.input_layernorm.weight, *[lin.weight for lin in linears[:4]],
                  layer.post_attention_layernorm.weight, *[lin.weight for lin in linears[4:]]]
            self.plan.append((ws, [lin.bias for lin in linears], linears,
                              a.q_proj.out_features // self.head_dim, a.k_proj.out_features // self.head_dim))
        self._layers, self._fusable = layers, fused is not None
        self._hold_fused(fused)
        self._codes: dict[tuple[str, str], list[list[int]]] = {}  # per (body, wide) path: each layer's codes
        self.choice: dict[str, bool] | None = None  # per shape class: lean or not (None: not measured yet)
        self.step_layer, self.rows_layer = target_step.step_fn(), target_step.rows_fn()
        self.fused_step = target_step.fused_step_fn() if fused is not None else None
        self.fused_rows_layer = target_step.fused_rows_fn() if fused is not None else None
        self._fused_packs: list[list[torch.Tensor | None]] = [[None, None] for _ in self.plan]
        # Per skinny_linear row bucket, whether passes over that many rows take the fused products: one-row
        # steps always do; for rows it is measured (the Xeon's packed sgemm was 5% slower fused at 16 rows).
        self.fused_rows: list[bool] | None = None
        self._fused_override: bool | None = None  # set while the choice is measured
        if self.exact and skinny_linear.PACKED in getattr(skinny_linear.installed(model), "body", ()):
            for i in range(len(self.plan)):  # packed now, as choose() packs the modules: not in a served pass
                for which in (0, 1):
                    self._fused_packed(i, which)
        self._step_codes = ([None] * 4 * len(self.plan), [0] * 4 * len(self.plan))  # one row: F.linear's GEMVs
        self.native: dict[str, bool] | None = None  # one-row steps ("step"), other passes ("rows"): run natively?
        self._native_override: bool | None = None  # set while that is measured
        self.whole: dict[str, bool] | None = None  # steps, passes, wide passes: run the whole lean pass?
        self._whole_override: bool | None = None  # set while that is measured
        self._rope_table = RopeTable(base.rotary_emb, self.head_dim)
        half = self.head_dim // 2
        self.perm = torch.cat((torch.arange(half, self.head_dim), torch.arange(half)))  # rotate_half as a gather

    def _final_norm(self) -> torch.Tensor | None:
        """The model's final RMSNorm weight where the whole lean pass can apply it (float32, the layers'
        epsilon), else None: base.norm runs after the pass."""
        norm = self.base.norm
        weight = getattr(norm, "weight", None)
        if weight is None or weight.dtype != torch.float32 or not weight.is_contiguous() or \
                float(getattr(norm, "variance_epsilon", -1.0)) != self.eps:
            return None
        return weight

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """A float Llama-family model whose decoder this forward reproduces: SiLU MLPs, plain linears, one
        RMSNorm epsilon, attention through starjar's folded implementation."""
        cfg = getattr(model, "config", None)
        if getattr(cfg, "model_type", None) not in FAMILIES or getattr(cfg, "hidden_act", None) != "silu" \
                or getattr(cfg, "_attn_implementation", None) != attention.NAME:
            return False
        if next(model.parameters()).dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        layers = model.base_model.layers[: cfg.num_hidden_layers]
        eps = {float(n.variance_epsilon) for layer in layers
               for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        linears = [lin for layer in layers for lin in layer.modules() if isinstance(lin, torch.nn.Linear)]
        return len(eps) == 1 and all(type(lin) is torch.nn.Linear for lin in linears) and \
            len(linears) == 7 * len(layers)

    def settle(self) -> None:
        """Measure the per-class choice now (at load, not in a served step) unless a forced one holds, and
        which row buckets take the fused products."""
        if forced() is None and self.choice is None:
            self.choice = lean_choices.lean_classes(self)
        self.takes_native(1)  # built, loaded and measured at load, not in a served step; before the fused choice,
        if self.exact and self.fused_rows is None:  # whose fused passes run natively where chosen
            self.fused_rows = lean_choices.fused_buckets(self)
            self._settle_packs()
        self.takes_whole(next(self.model.parameters()), 1)  # last: timed against the passes chosen above
        if not self.exact and self.fused is not None and not (self.whole and any(self.whole.values())):
            self._hold_fused(None)  # copies no pass reads (made again if the whole pass is forced on later)

    def _hold_fused(self, fused: list | None) -> None:
        """Keep fused_projections.fuse's concatenations as the passes take them (per layer: six weights, four
        biases, the head counts) and, for the native passes, as flat lists; None drops them."""
        self.fused = None if fused is None else (
            [[ws[0], wq, ws[4], ws[5], wg, ws[8]] for (ws, *_), (wq, _, wg, _) in zip(self.plan, fused, strict=True)],
            [[bq, bs[3], bg, bs[6]] for (_, bs, *_), (_, bq, _, bg) in zip(self.plan, fused, strict=True)],
            [nq for *_, nq, _ in self.plan], [nk for *_, nk in self.plan])
        self.flat = None if fused is None else ([w for ws in self.fused[0] for w in ws],
                                                [b for bs in self.fused[1] for b in bs])

    def _settle_packs(self) -> None:
        """Keep packed the weights the packed product will read: the whole qkv and gate-up where a bucket on
        the packed path runs fused, the modules' own where one runs them apart (packed now, not in a pass)."""
        paths = skinny_linear.installed(self.model)
        if paths is None:
            return
        packed = [on for on, path in zip(self.fused_rows, paths.body, strict=True) if path == skinny_linear.PACKED]
        if True not in packed:
            self._fused_packs = [[None, None] for _ in self.plan]
        if False in packed:
            for lin in self._fused_modules():
                skinny_linear.packed_weight(lin)

    def takes_fused(self, rows: int) -> bool:
        """Whether a chain pass over `rows` rows (B x Q) runs the fused products."""
        if not self.exact:
            return False
        if self._fused_override is not None:
            return self._fused_override
        if rows == 1:
            return True
        if self.fused_rows is None:
            self.fused_rows = lean_choices.fused_buckets(self)
        return self.fused_rows[skinny_linear.bucket_index(rows)]

    def takes_native(self, rows: int) -> bool:
        """Whether a chain pass over `rows` rows (B x Q) runs natively (starjar.model.native_pass): forced by
        its variable, or measured against the scripted layers once per machine and shapes."""
        if not self.exact:
            return False
        if self._native_override is not None:
            return self._native_override
        force = native_pass.required()
        if force is False:
            return False
        if self.native is None:
            param = next(self.model.parameters())
            on = native_pass.takes(param) and native_pass.available()
            self.native = lean_choices.native_classes(self) if on else {"step": False, "rows": False}
        return bool(force) or self.native["step" if rows == 1 else "rows"]

    def takes_whole(self, x: torch.Tensor, rows: int) -> bool:
        """Whether a chain pass over `rows` rows (B x Q) on consecutive slots runs the whole lean pass
        (starjar.model.lean_pass): forced by its variable (up to LONG rows), or measured once per machine and
        shapes against the passes the other choices give."""
        if not self._fusable or rows > LONG or not native_pass.takes(x):
            return False
        if self._whole_override is not None:
            return self._whole_override
        force = lean_pass.forced()
        if force is False or not lean_pass.available():
            return False
        if self.fused is None:  # dropped copies, the pass forced on since
            self._hold_fused(fused_projections.fuse(self._layers)[0])
        if self.whole is None:
            self.whole = lean_choices.whole_classes(self) if force is None else \
                dict.fromkeys(lean_choices.WHOLE_CLASSES, True)
        return bool(force) or self.whole["step" if rows == 1 else "rows" if rows <= lean_choices.WIDE_FROM else "wide"]

    def wants(self, b: int, q: int) -> bool:
        """Whether a chain pass of b rows of q tokens runs lean: its class measured so, or the whole lean pass
        taken for it (measured against what the other choices give)."""
        force = forced()
        if force is not None:
            return force
        if self.choice is None:
            self.choice = lean_choices.lean_classes(self)
        return self.choice[shape_class(b, q)] or self.takes_whole(next(self.model.parameters()), b * q)

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
               cache: RaggedKVCache) -> torch.Tensor | None:
        """HF's base_model(...).last_hidden_state for the pass the cache's begin() prepared, or None where
        this pass runs HF's forward (its class is not chosen here)."""
        b, q = input_ids.shape
        return self.run(input_ids, position_ids, mask, cache) if self.wants(b, q) else None

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
            cache: RaggedKVCache) -> torch.Tensor | None:
        """The lean forward, whatever the choice; None for a pass the cache cannot give views of."""
        cache.make_buffers(len(self.plan), self.kv_heads, self.head_dim, self.head_dim)
        views = cache.pass_views(len(self.plan), trees=True)  # every layer attends with the pass's mask
        if views is None:
            return None
        keys, values, rows, write, start, kv_len = views
        base = self.base
        x = base.embed_tokens(input_ids)
        cos, sin, signed = self._rope(x, position_ids)
        b, q = input_ids.shape
        d, eps, scaling = self.head_dim, self.eps, self.scaling
        if rows is None and self.takes_whole(x, b * q):
            final = self._final_norm()
            out = lean_pass.run(x, cos, signed, mask, *self.flat, keys, values, start, kv_len, *self.fused[2:], d,
                                eps, scaling, write, norm=final)
            return out if final is not None else base.norm(out)
        if b == 1 and q == 1 and rows is None and write is None and self.takes_fused(1):
            ws, bs, nqs, nks = self.fused
            if native_pass.takes(x) and self.takes_native(1):
                return base.norm(native_pass.run(x, cos, signed, mask, *self.flat, *self._step_codes,
                                                 keys, values, start, kv_len, nqs, nks, d, eps, scaling))
            return base.norm(self.fused_step(x, cos, signed, self.perm.to(x.device), mask, ws, bs, keys,
                                             values, start, kv_len, nqs, nks, d, eps, scaling))
        if b == 1 and q == 1 and rows is None and write is None:
            for (ws, bs, _, nq, nk), k, v in zip(self.plan, keys, values, strict=True):
                x = self.step_layer(x, cos, sin, mask, ws, bs, k, v, start, kv_len, nq, nk, d, eps, scaling)
            return base.norm(x)
        codes = self._layer_codes(x, b * q)
        own = any(target_step.OWN in c for c in codes)  # starjar's own product: the native pass runs it, or HF's
        if self.takes_fused(b * q) and (not own or self._runs_native(x, rows, b * q)):
            return base.norm(self._fused_rows_pass(x, cos, sin, mask, codes, views, q))
        if own:
            return None
        folded: dict[int, torch.Tensor] = {}  # the mask as folded_attention folds it, once per pass
        for (ws, bs, linears, nq, nk), k, v, c in zip(self.plan, keys, values, codes, strict=True):
            g = nq // nk
            if g not in folded:
                folded[g] = mask if g == 1 or q == 1 else attention.fold_mask(mask, g)
            packs = [skinny_linear.packed_weight(lin) if code == 2 else None for lin, code in zip(linears, c,
                                                                                                  strict=True)]
            x = self.rows_layer(x, cos, sin, folded[g], ws, bs, packs, c, k, v, rows, write, start, kv_len,
                                nq, nk, d, eps, scaling)
        return base.norm(x)

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin and signed sin [B, 1, Q, D] (as apply_rotary_pos_emb unsqueezes them): the table's rows where
        they are the rotary module's bits, else the module's."""
        held = self._rope_table.lookup(x, position_ids)
        if held is not None:
            return held
        cos, sin = self.base.rotary_emb(x, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin, _signed_sin(sin)

    def _fused_rows_pass(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                         codes: list[list[int]], views: tuple, q: int) -> torch.Tensor:
        """A chain pass other than a one-row step over the fused projections: native where its rows are on
        consecutive slots and it was chosen, else layer by layer scripted."""
        keys, values, rows, write, start, kv_len = views
        d = self.head_dim
        sin_signed = _signed_sin(sin)
        ws, bs, nqs, nks = self.fused
        layer_paths, layer_packs = [], []
        for i, (c, (_, _, linears, _, _)) in enumerate(zip(codes, self.plan, strict=True)):
            paths = [c[0], c[3], c[4], c[6]]  # qkv takes q's path, gate-up gate's
            layer_paths.append(paths)
            layer_packs.append([self._fused_packed(i, 0) if paths[0] == 2 else None,
                                skinny_linear.packed_weight(linears[3]) if paths[1] == 2 else None,
                                self._fused_packed(i, 1) if paths[2] == 2 else None,
                                skinny_linear.packed_weight(linears[6]) if paths[3] == 2 else None])
        if self._runs_native(x, rows, x.shape[0] * q):
            g = nqs[0] // nks[0]
            if any(target_step.OWN in c for c in layer_paths):
                few_rows.use_forced_isa()
            return native_pass.run(x, cos, sin_signed, mask if g == 1 or q == 1 else attention.fold_mask(mask, g),
                                   *self.flat, [p for packs in layer_packs for p in packs],
                                   [c for paths in layer_paths for c in paths], keys, values, start, kv_len, nqs,
                                   nks, d, self.eps, self.scaling, write)
        perm = self.perm.to(x.device)
        folded: dict[int, torch.Tensor] = {}  # the mask as folded_attention folds it, once per pass
        for i, (nq, nk) in enumerate(zip(nqs, nks, strict=True)):
            g = nq // nk
            if g not in folded:
                folded[g] = mask if g == 1 or q == 1 else attention.fold_mask(mask, g)
            x = self.fused_rows_layer(x, cos, sin_signed, perm, folded[g], ws[i], bs[i], layer_packs[i],
                                      layer_paths[i], keys[i], values[i], rows, write, start, kv_len, nq, nk, d,
                                      self.eps, self.scaling)
        return x

    def _runs_native(self, x: torch.Tensor, rows: torch.Tensor | None, n: int) -> bool:
        """Whether a fused chain pass over n rows in all runs natively: consecutive slots, one head grouping."""
        _, _, nqs, nks = self.fused
        return rows is None and len({nq // nk for nq, nk in zip(nqs, nks, strict=True)}) == 1 and \
            native_pass.takes(x) and self.takes_native(n)

    def _fused_packed(self, layer: int, which: int) -> torch.Tensor:
        """Layer's packed qkv (which 0) or gate-up (1) weight, packed on first use."""
        held = self._fused_packs[layer]
        if held[which] is None:
            held[which] = skinny_linear.pack(self.fused[0][layer][1 if which == 0 else 4])
        return held[which]

    def _layer_codes(self, x: torch.Tensor, rows: int) -> list[list[int]]:
        """Each layer's seven product codes (target_step.PATHS) for a pass over `rows` rows: the paths
        skinny_linear installed, F.linear where it would not intervene (one row, not float32 on the CPU)."""
        body, wide = ("linear", "linear") if x.dtype != torch.float32 or x.device.type != "cpu" \
            else skinny_linear.bucket_paths(self.model, rows)
        key = (body, wide)
        if key not in self._codes:
            self._codes[key] = [[target_step.PATHS[wide if skinny_linear.is_wide(lin) else body]
                                 for lin in linears] for _, _, linears, _, _ in self.plan]
        return self._codes[key]

    def _fused_modules(self):
        """The linears whose weights are views of the fused products: q, k, v, gate and up of each layer."""
        for _, _, linears, _, _ in self.plan:
            yield from (*linears[:3], *linears[4:6])

    def _drop_module_packs(self) -> None:
        """Free the packed copies that passes over the fused modules' own weights made (HF's forward, or the
        lean one with the projections apart); the fused products pack the whole."""
        if self.fused is not None:
            for lin in self._fused_modules():
                skinny_linear.drop_packed(lin)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with rotate_half's sign folded in (its first half negated), for the fused layers' gather."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
