"""Tree proposers for tests: a real model's top candidates per node, with a chosen sibling order.

Not the draft server's beam search (draft_server/tree_draft.py): a small, obviously correct builder that
runs the model without a cache, so that tree verification is tested against trees of known shape.
"""

from __future__ import annotations

import torch

from starjar.spec.token_tree import TokenTree


class TopKTreeProposer:
    """widths[k]: how many children each node of depth k gets (top tokens of `model` after its path).
    argmax_last: put the model's best token last among siblings (forces accepted paths through later
    candidates, and so KV moves, when the model is the target itself)."""

    def __init__(self, model, widths=(2, 2, 1), argmax_last: bool = False):
        self.model, self.widths, self.argmax_last = model, tuple(widths), argmax_last
        self.hist: dict = {}
        self.calls = 0

    def propose(self, requests):
        out = []
        for r in requests:
            hist = (self.hist.get(r.seq_id, []) if r.start else [])[: r.start] + list(r.tokens)
            self.hist[r.seq_id] = hist
            out.append(self.build(hist) if r.gamma else [])
        self.calls += 1
        return out

    def release(self, seq_ids):
        for s in seq_ids:
            self.hist.pop(s, None)

    @torch.no_grad()
    def build(self, ids: list[int]) -> TokenTree:
        tokens, parents, probs = [], [], []
        frontier = [(-1, [], 1.0)]  # (node, path tokens, path prob)
        for width in self.widths:
            batch = torch.tensor([ids + path for _, path, _ in frontier])
            logits = self.model.model(input_ids=batch).logits[:, -1].float()
            nxt = []
            for (node, path, f), row in zip(frontier, torch.softmax(logits, -1), strict=True):
                top = torch.topk(row, width)
                order = list(range(width))
                if self.argmax_last and width > 1:
                    order = order[1:] + order[:1]
                for j in order:
                    tokens.append(int(top.indices[j]))
                    parents.append(node)
                    probs.append(f * float(top.values[j]))
                    nxt.append((len(tokens) - 1, path + [tokens[-1]], probs[-1]))
            frontier = nxt
        return TokenTree(tokens, parents, probs)
