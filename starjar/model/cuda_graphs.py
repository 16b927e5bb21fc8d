"""A float Llama-family model's decoder as CUDA graphs: captured once per pass shape, then replayed.

On a GPU a batch-1 step of a small model is launch-bound: the default target's 30 layers issue a few hundred
kernels a step, each a few microseconds of GPU work behind Python, hooks and dispatch. A graph replays them
all from one launch. A graph fixes every shape and address, so the pass it captures (StaticDecoder) is written
for that: it attends over the rows' whole cache capacity with the pass's mask padded (masked keys weigh exactly
zero after the softmax), writes K and V by scatter at the positions RaggedKVCache.begin chose, and reads its
ids, positions, mask and write positions from tensors the replay's inputs are copied into.

A graph is kept per (rows, tokens, cache buffers as addressed): one per pass shape of the engine's rounds (a
decode step, a verification over gamma + 1 positions, a tree) until the cache grows. A shape is captured the
second time it runs (its first run is the static pass, eagerly): a short prompt's one-off length costs no
capture (a warm-up run, the capture and a replay: about three passes). Passes over more than
MAX_ROWS tokens (prefill) are not launch-bound and run HF's forward; so do passes over scattered slots. The
captured graphs share one memory pool, which is safe because each replay's output is copied out before the
next replay; at most MAX_GRAPHS are kept (least recently used dropped).

Measured on one H100 (benchmarks/probes/gpu_graph_speed.py, a pair of the default target's shapes): the
target alone decodes at batch 1 / 4 / 8 / 16 5.1x / 3.8x / 2.2x / 2.2x faster than through HF's forward
(40 -> 203 tokens/s at batch 1; 6.7x in another run); a step's host work outside the graph is what remains.

The function is the same as HF's forward, with attention reduced over the padded key axis: greedy output is
HF generate()'s (tested), logits agree to the last few bits, not all of them. STARJAR_CUDA_GRAPHS=0 turns it
off, 1 forces the static pass wherever it applies, on the CPU too (run eagerly there: how the tests check it
without a GPU); unset, CUDA models take it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import torch.nn.functional as F

from starjar.cpu import kernels
from starjar.model.kv_cache import RaggedKVCache
from starjar.model.lean_decoder import rope

log = logging.getLogger(__name__)

ENV = "STARJAR_CUDA_GRAPHS"
MAX_ROWS = 64  # tokens in a pass (B x Q) past which it runs eagerly: prefill is not launch-bound
MAX_GRAPHS = 48  # captured graphs kept; each holds its static inputs and output
SEEN = 256  # shapes remembered as run once: a shape is captured the second time it runs


def forced() -> bool | None:
    return kernels.forced_switch(ENV)


class StaticDecoder:
    """HF's decoder layers over cache rows of fixed capacity: every shape and address fixed by the pass shape."""

    def __init__(self, model: torch.nn.Module):
        self.base = model.base_model
        self.layers = list(self.base.layers[: model.config.num_hidden_layers])
        att = self.layers[0].self_attn
        self.head_dim, self.scaling = att.head_dim, float(att.scaling)
        self.heads = [(lay.self_attn.q_proj.out_features // self.head_dim,
                       lay.self_attn.k_proj.out_features // self.head_dim) for lay in self.layers]

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, write: torch.Tensor,
                 keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """ids, pos, write [B, Q]; mask [B, 1, Q, C] additive over each row's C cached positions; keys and
        values per layer [B, Hkv, C, D], written in place. Returns the final norm's output [B, Q, hidden]."""
        b, q = ids.shape
        d = self.head_dim
        x = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(x, position_ids=pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, Q, D]
        at = write[:, None, :, None]
        for layer, (nq, nk), kb, vb in zip(self.layers, self.heads, keys, values, strict=True):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            qs = rope(a.q_proj(h).view(b, q, nq, d).transpose(1, 2), cos, sin)
            ks = rope(a.k_proj(h).view(b, q, nk, d).transpose(1, 2), cos, sin)
            vs = a.v_proj(h).view(b, q, nk, d).transpose(1, 2)
            kb.scatter_(2, at.expand(-1, nk, -1, d), ks.to(kb.dtype))
            vb.scatter_(2, at.expand(-1, nk, -1, d), vs.to(vb.dtype))
            out = F.scaled_dot_product_attention(qs, kb, vb, attn_mask=mask, scale=self.scaling,
                                                 enable_gqa=nq != nk)
            x = x + a.o_proj(out.transpose(1, 2).reshape(b, q, nq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.base.norm(x)


class _Graph:
    """One captured pass: its static inputs, the graph and its output."""

    def __init__(self, ids, pos, mask, write):
        self.ids, self.pos, self.mask, self.write = ids, pos, mask, write
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None


class GraphedDecoder:
    """Runs a model's chain and tree passes over consecutive cache slots as replayed CUDA graphs."""

    def __init__(self, model: torch.nn.Module, max_graphs: int = MAX_GRAPHS):
        self.decoder = StaticDecoder(model)
        self.device = next(model.parameters()).device
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()  # shapes run once, uncaptured (the latest SEEN)
        self.pool = None
        self.captures = self.replays = 0  # counted for the probe and the tests
        self._weights = self._weight_addresses()  # where the captured graphs read the weights

    def _weight_addresses(self) -> tuple[int, int]:
        """Where the first and last weights are: moving the model (the draft server's offload and reload)
        moves them, and graphs captured before would read freed memory."""
        return self.decoder.base.embed_tokens.weight.data_ptr(), self.decoder.base.norm.weight.data_ptr()

    def drop(self) -> None:
        """Forget every captured graph (the weights moved, or their memory is wanted back)."""
        self.graphs.clear()
        self.seen.clear()
        self.pool = None

    def active(self) -> bool:
        """Whether passes take it now: on CUDA unless turned off; elsewhere only where forced."""
        force = forced()
        return force if force is not None else self.device.type == "cuda"

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
               cache: RaggedKVCache) -> torch.Tensor | None:
        """The pass begin() prepared as HF's base_model(...).last_hidden_state would give it, or None where
        this pass runs HF's forward (too many tokens, scattered slots, or turned off)."""
        b, q = ids.shape
        if b * q > MAX_ROWS or not self.active():
            return None
        layers = len(self.decoder.layers)
        cache.make_buffers(layers, self.decoder.heads[0][1], self.decoder.head_dim, self.decoder.head_dim)
        views = cache.pass_views(layers, trees=True)
        if views is None or views[2] is not None:  # not begun through the views, or scattered slots
            return None
        keys, values = views[0], views[1]
        full = _padded(mask, keys[0].shape[2])
        write = cache.write_positions()
        if self.device.type != "cuda":
            return self.decoder(ids, pos, full, write, keys, values)
        if self._weight_addresses() != self._weights:
            self.drop()
            self._weights = self._weight_addresses()
        key = (b, q, tuple(keys[0].shape), keys[0].stride(), tuple(t.data_ptr() for t in keys + values))
        g = self.graphs.get(key)
        if g is None and key not in self.seen:  # a first sight (a prompt's length, say) may never recur
            self.seen[key] = None
            while len(self.seen) > SEEN:
                self.seen.popitem(last=False)
            return self.decoder(ids, pos, full, write, keys, values)
        if g is None:
            return self._capture(key, ids, pos, full, write, keys, values)
        self.graphs.move_to_end(key)
        g.ids.copy_(ids)
        g.pos.copy_(pos)
        g.mask.copy_(full)
        g.write.copy_(write)
        g.graph.replay()
        self.replays += 1
        return g.out.clone()  # the next replay of any graph in the pool may reuse the output's memory

    def _capture(self, key: tuple, ids, pos, full, write, keys, values) -> torch.Tensor:
        """Capture this pass's shape: one eager run on a side stream (it writes this pass's K and V, and
        initialises the libraries' handles outside the capture), then the capture, whose output is this
        pass's too (the same inputs)."""
        g = _Graph(ids.clone(), pos.clone(), full.clone(), write.clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.decoder(g.ids, g.pos, g.mask, g.write, keys, values)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work during this capture (a gRPC handler, a reload) is not an error.
        with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode="thread_local"):
            g.out = self.decoder(g.ids, g.pos, g.mask, g.write, keys, values)
        g.graph.replay()
        self.graphs[key] = g
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        log.debug("captured a CUDA graph for %d rows x %d tokens over %d cached positions (%d kept)",
                  ids.shape[0], ids.shape[1], full.shape[-1], len(self.graphs))
        return g.out.clone()


def _padded(mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """The pass's [B, 1, Q, K] additive mask over all `capacity` cached positions, the rest masked."""
    if mask.shape[-1] == capacity:
        return mask
    full = mask.new_full((*mask.shape[:-1], capacity), torch.finfo(mask.dtype).min)
    full[..., : mask.shape[-1]] = mask
    return full
