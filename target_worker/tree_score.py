"""The score phase of a decode step where some sequences carry token trees.

One ragged pass feeds every round's pending token and its drafts: a chain as before, a tree as its nodes in
topological order under a tree mask (starjar.model.tree_attention). Each round gets its verdict; a tree round's
accepted path, written at scattered cache positions, is moved to the positions right after its pending
token, and everything past it is rolled back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from starjar.errors import InvalidArgument
from starjar.model.kv_cache import RaggedKVCache
from starjar.model.loading import LoadedModel
from starjar.model.tree_attention import feed_parents
from starjar.spec.token_ids import first_out_of_range
from starjar.spec.token_tree import MAX_TREE_NODES, TokenTree
from starjar.spec.tree_select import POLICIES, Candidate, select, slo_need
from starjar.spec.tree_verify import verify_tree
from starjar.spec.verify import verify


def score_rounds(model: LoadedModel, cache: RaggedKVCache, rounds: Sequence) -> None:
    """rounds: the engine's SeqRounds (req, draft, tree); sets each round's verdict and rolls its KV back."""
    ordered = sorted(rounds, key=lambda r: r.req.slot)
    feeds = [[r.req.output_ids[-1]] + (list(r.tree.tokens) if r.tree is not None else r.draft) for r in ordered]
    trees = [(0, feed_parents(r.tree.parents)) if r.tree is not None else None for r in ordered]
    logits = model.forward(cache, [r.req.slot for r in ordered], feeds, [list(range(len(f))) for f in feeds],
                           trees)
    for r, lg in zip(ordered, logits, strict=True):
        base = r.req.num_tokens - 1  # the pending token's cache position
        if r.tree is None:
            r.verdict = verify(lg, r.draft, r.req.params, r.req.draws, r.req.num_tokens)
        else:
            r.verdict = verify_tree(lg, r.tree, r.req.params, r.req.draws, r.req.num_tokens)
            keep_path(cache, r.req.slot, base, r.verdict.path)
        cache.truncate(r.req.slot, base + 1 + r.verdict.num_accepted)


def keep_path(cache: RaggedKVCache, slot: int, base: int, path: Sequence[int]) -> None:
    """Node i was written at base + 1 + i; the k-th accepted node belongs at base + 1 + k. Sources are never
    below their destinations and the copy reads before it writes, so the order is safe."""
    cache.move(slot, [base + 1 + i for i in path], [base + 1 + k for k in range(len(path))])


def as_tree(reply, vocab: int, max_nodes: int, max_depth: int) -> TokenTree | list[int] | None:
    """A proposer's reply for one round: a chain (list, at most max_depth tokens), a tree cut to max_nodes
    and max_depth, or None when unusable."""
    if isinstance(reply, TokenTree):
        tree = reply.within_depth(max_depth).prefix(max_nodes)
        if first_out_of_range(tree.tokens, vocab) is not None:
            return None
        return list(tree.tokens) if tree.is_chain else tree
    chain = [int(t) for t in reply[:max_depth]]
    return chain if first_out_of_range(chain, vocab) is None else None


@dataclass(frozen=True)
class TreeConfig:
    """Token trees on a target engine: the selection policy (starjar.spec.tree_select.POLICIES), the draft's beam
    width, the verification budget (tokens per pass, pending tokens included; `starjar profile` measures
    where the step time stays near flat) and the most nodes one sequence may get."""

    policy: str = "adaserve"
    width: int = 3
    budget: int = 32
    cap: int = 16

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidArgument("tree", f"one of {', '.join(POLICIES)}", self.policy)
        for name, lo, hi in (("width", 1, 16), ("budget", 1, 4096), ("cap", 1, MAX_TREE_NODES)):
            if not lo <= getattr(self, name) <= hi:
                raise InvalidArgument(f"tree_{name}", f"must be in [{lo}, {hi}]", getattr(self, name))


class TreeSelector:
    """Per step: the candidate trees the proposer gave, cut to what the budget verifies (AdaServe's
    selection phases), with each request's TPOT SLO need from its decode time so far and the step time."""

    def __init__(self, cfg: TreeConfig):
        self.cfg = cfg
        self.step_s = 0.0  # moving average of decode step time: AdaServe's t_spec
        self.select_s: list[float] = []  # per step: the selection's time (AdaServe Figure 9), bounded
        self.draft_width = cfg.width if cfg.policy != "chain" else 0

    def shape(self, n: int, gamma: int) -> tuple[int, int]:
        """(depth, width) of the candidate trees for n sequences (AdaServe eq. 8-9): depth ceil(B/n) and width
        floor(B/n), within gamma (D_max, the policy's) and the configured width (W_max)."""
        b = self.cfg.budget
        depth = max(1, min(gamma, -(-b // max(1, n))))
        width = max(1, min(self.draft_width, b // max(1, n))) if self.draft_width else 0
        return depth, width

    def observe_step(self, seconds: float) -> None:
        self.step_s = seconds if not self.step_s else 0.8 * self.step_s + 0.2 * seconds

    def select(self, rounds: Sequence) -> None:
        """rounds: the step's SeqRounds; those with a tree get the selected part of it (or none)."""
        with_tree = [r for r in rounds if r.tree is not None]
        if not with_tree:
            return
        t0 = time.perf_counter()
        now = time.perf_counter()
        cands = []
        for r in with_tree:
            decoded = max(0, len(r.req.output_ids) - 1)
            elapsed = now - r.req.first_token_s if r.req.first_token_s else 0.0
            need = slo_need(getattr(r.req, "tpot_slo_s", None), elapsed, decoded, self.step_s)
            cands.append(Candidate(r.tree, need, min(self.cfg.cap, MAX_TREE_NODES)))
        # Sequences that carry chains this step still cost their tokens in the pass.
        chains = sum(len(r.draft) + 1 for r in rounds if r.tree is None)
        chosen = select(cands, self.cfg.budget - chains, self.cfg.policy)
        for r, tree in zip(with_tree, chosen, strict=True):
            r.tree, r.draft = (tree, list(tree.tokens)) if len(tree) else (None, [])
        self.select_s.append(time.perf_counter() - t0)
        del self.select_s[:-4096]


MAX_TPOT_SLO_S = 3600.0


def tpot_timing(timing, req) -> None:
    """The last message's timing: achieved TPOT (first token to last, over the tokens after the first) and,
    when the request gave a TPOT SLO, whether it held."""
    n = len(req.output_ids)
    if req.first_token_s is None or req.finish_s is None or n < 2:
        tpot = 0.0
    else:
        tpot = (req.finish_s - req.first_token_s) / (n - 1)
    timing.tpot_s = tpot
    if req.tpot_slo_s is not None:
        timing.tpot_slo_met = tpot <= req.tpot_slo_s
