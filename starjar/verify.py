"""Exact speculative verification for deterministic (greedy-chain) proposals.

Vocabulary, per sequence with gamma draft tokens d_1..d_gamma:
  accepted  the leading drafts the target keeps,
  recovered the token sampled in place of the first rejected draft,
  bonus     the token sampled after all gamma drafts were accepted.
Each round therefore emits accepted + exactly one recovered-or-bonus token.

With a deterministic proposal q = one-hot(d_i), the classic rule
min(1, p/q) becomes "accept d_i with probability p(d_i)", and the residual
max(0, p - q) renormalised is p with d_i removed. The emitted tokens are thus
distributed exactly as the target's own samples, at any temperature, top-p
or top-k; greedy reduces to "accept while d_i == argmax".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from starjar.sampling import SamplingParams, finite_logits, logits_to_probs


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # accepted drafts + one recovered or bonus token
    num_accepted: int  # how many drafts were kept (0..gamma)


def verify(
    logits: torch.Tensor, draft: list[int], params: SamplingParams, gen: torch.Generator | None
) -> Verdict:
    """logits: [gamma+1, V], the target's logits at the last verified token and at each draft.

    Row i scores the token that follows draft i (row 0 follows the verified prefix).
    """
    gamma = len(draft)
    assert logits.dim() == 2 and logits.shape[0] == gamma + 1, (logits.shape, gamma)
    if params.greedy:
        best = finite_logits(logits).argmax(-1).tolist()  # torch's argmax would pick a NaN
        k = 0
        while k < gamma and draft[k] == best[k]:
            k += 1
        return Verdict(tokens=list(draft[:k]) + [best[k]], num_accepted=k)

    probs = logits_to_probs(logits, params)  # [gamma+1, V]
    if gamma:
        draft_t = torch.tensor(draft, dtype=torch.long)
        p_draft = probs[torch.arange(gamma), draft_t]  # [gamma]
        u = torch.rand(gamma, generator=gen)
        rejected = (u >= p_draft).nonzero()
        k = int(rejected[0]) if len(rejected) else gamma
    else:
        k = 0
    if k < gamma:
        residual = probs[k].clone()
        residual[draft[k]] = 0.0
        # p(d_k) < 1 here (u < 1 always accepts a sure token), so the residual has mass.
        nxt = int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    else:
        nxt = int(torch.multinomial(probs[gamma], 1, generator=gen))
    return Verdict(tokens=list(draft[:k]) + [nxt], num_accepted=k)


def sample_next(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One plain decoding step: logits [V] -> token id."""
    return verify(logits.unsqueeze(0), [], params, gen).tokens[0]
