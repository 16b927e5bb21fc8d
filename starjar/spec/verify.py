"""Exact speculative verification for deterministic (greedy-chain) proposals.

Vocabulary, per sequence with gamma draft tokens d_1..d_gamma:
  accepted  the leading drafts the target keeps,
  recovered the token sampled in place of the first rejected draft,
  bonus     the token sampled after all gamma drafts were accepted.
Each round therefore emits accepted + exactly one recovered-or-bonus token.

Every position's token is the target's own choice there: the argmax when greedy, else the request's draw at
that position (starjar.spec.sampling.PositionDraws: p's inverse CDF at a uniform of that position). A draft is kept
while it equals that choice. With a deterministic proposal q = one-hot(d_i), the classic rule min(1, p/q)
accepts d_i with probability p(d_i) and otherwise samples p with d_i removed, renormalised; an exact draw of p
equals d_i with that same probability and, when it does not, is distributed as that same residual. So the
emitted tokens are distributed exactly as the target's own samples, at any temperature, top-p or top-k, and
they are the very tokens plain decoding with the same seed emits, whatever was drafted. Rows are looked at only
up to the first rejection: a row the target alone would never compute cannot fail a round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from starjar.spec.sampling import PositionDraws, SamplingParams, finite_logits, logits_to_probs


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # accepted drafts + one recovered or bonus token
    num_accepted: int  # how many drafts were kept (0..gamma)


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams, draws: PositionDraws | None,
           position: int = 0) -> Verdict:
    """logits: [gamma+1, V], the target's logits at the last verified token and at each draft.

    Row i scores the token that follows draft i (row 0 follows the verified prefix); position: the sequence
    position of the token row 0 chooses (row i chooses position + i)."""
    gamma = len(draft)
    assert logits.dim() == 2 and logits.shape[0] == gamma + 1, (logits.shape, gamma)
    for k in range(gamma + 1):
        chosen = choose(logits[k], params, draws, position + k)
        if k == gamma or draft[k] != chosen:
            return Verdict(tokens=list(draft[:k]) + [chosen], num_accepted=k)
    raise AssertionError("unreachable: row gamma always decides")


def choose(logits: torch.Tensor, params: SamplingParams, draws: PositionDraws | None, position: int) -> int:
    """The target's token at `position` from its logits [V] there: the argmax (torch's would pick a NaN, hence
    finite_logits) when greedy, else the request's draw at that position."""
    if params.greedy:
        best = int(logits.argmax())
        # A finite maximum means no NaN and no +inf (argmax would have picked either): finite_logits would change
        # nothing that decides the argmax, and its full pass over the vocabulary (0.3 ms a step at 49k) is spared.
        return best if math.isfinite(float(logits[best])) else int(finite_logits(logits).argmax())
    assert draws is not None, "a sampled request has its draws"
    return draws.sample(logits_to_probs(logits, params), position)


def sample_next(logits: torch.Tensor, params: SamplingParams, draws: PositionDraws | None, position: int = 0) -> int:
    """One plain decoding step: logits [V] -> token id at `position`."""
    return choose(logits, params, draws, position)
