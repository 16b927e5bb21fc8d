"""Per-request sampling parameters and the one probability function.

`logits_to_probs` is used on both sides of speculative verification (the
target's distribution p at every verified position); keeping a single
function guarantees that acceptance and resampling see the same p.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starjar.errors import InvalidArgument
from starjar.spec.token_ids import check_token_ids

if TYPE_CHECKING:  # torch loads on first use, so `import starjar` (the SDK) stays light
    import torch

# Upper bounds that keep a single request from monopolising a server.
MAX_TOKENS_LIMIT = 1 << 16
MAX_STOP_IDS = 64
MAX_TOP_K = (1 << 31) - 1  # the wire's int32; any value past the vocabulary means no cut
# Temperatures below this are greedy: logits / 1e-39 overflow to inf and softmax gives NaN, and a
# distribution that sharp is argmax anyway (at 1e-5 a logit gap of 0.001 is a factor e^100).
GREEDY_BELOW = 1e-5
# The highest temperature accepted (OpenAI's API stops at 2; vLLM and HF have no limit). Past it a request is
# noise, and inf (JSON 1e400, a float32 field given 1e39) divides every logit to 0. A float32 number, so a
# value accepted here is still accepted after the wire's float32.
MAX_TEMPERATURE = 100.0
# The smallest top_p accepted: float32's smallest normal number (2^-126). Smaller ones turn into 0, or lose
# digits, on the wire; any top_p below the top token's probability keeps that token alone anyway.
MIN_TOP_P = 2.0 ** -126


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler. temperature 0 (or below GREEDY_BELOW) means greedy; at most
    MAX_TEMPERATURE. top_p in [MIN_TOP_P, 1]."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # frozen dataclass: normalise through object.__setattr__
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidArgument("max_tokens", "must be an integer", self.max_tokens)
        if not 0 < self.max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidArgument("max_tokens", f"must be in [1, {MAX_TOKENS_LIMIT}]", self.max_tokens)
        # NaN fails both comparisons. The value shown is the one given, before any float32 conversion.
        if not (0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument("temperature", f"must be >= 0 (0 = greedy) and <= {MAX_TEMPERATURE:g}",
                                  self.temperature)
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument("top_p", "must be in (0, 1]", self.top_p)
        if self.top_p < MIN_TOP_P:
            raise InvalidArgument("top_p", "must be at least 2^-126 (about 1.2e-38): float32, the wire's type, "
                                  "has no smaller normal number", self.top_p)
        if self.top_k < 0:
            raise InvalidArgument("top_k", "must be >= 0 (0 = disabled)", self.top_k)
        if self.top_k > MAX_TOP_K:
            raise InvalidArgument("top_k", f"must be <= {MAX_TOP_K}", self.top_k)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument("seed", "must be in [0, 2^63)", self.seed)
        if len(self.stop_token_ids) > MAX_STOP_IDS:
            raise InvalidArgument("stop_token_ids", f"at most {MAX_STOP_IDS} ids", len(self.stop_token_ids))
        if vocab_size is not None:
            check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def make_draws(self) -> PositionDraws:
        """A request's own randomness: seeded runs repeat, unseeded ones never collide."""
        return PositionDraws(self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)


class PositionDraws:
    """A sampled request's randomness, one independent draw per sequence position.

    The token at position t is p_t's inverse CDF at u_t, a uniform drawn from (seed, t) alone: an exact sample of
    p_t. A plain step and a verification (chain or tree) that choose the token at t use the same u_t, so what a
    request outputs depends on its seed and the target's distributions only, never on what was drafted, nor on
    whether a draft came at all. With a deterministic draft, "keep d while it is the token the draw picks"
    accepts d with probability p_t(d), classic speculative sampling's acceptance, and the token picked in its
    place is distributed as p_t without d, renormalised."""

    def __init__(self, seed: int):
        self.seed = seed

    def uniform(self, position: int) -> float:
        """u_t in [0, 1): 53 bits of the position's mixed seed."""
        return (_mix(self.seed, position) >> 10) * 2.0 ** -53

    def sample(self, probs: torch.Tensor, position: int) -> int:
        """probs [V] (zeros allowed, not all): the token at `position`."""
        import torch

        cdf = probs.double().cumsum(-1)
        pick = int(torch.searchsorted(cdf, self.uniform(position) * float(cdf[-1]), right=True))
        if pick >= cdf.shape[-1] or float(probs[pick]) <= 0.0:  # rounding at the top: the last token with mass
            pick = int(probs.nonzero()[-1])
        return pick


_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """63 bits mixed from (seed, position): splitmix64's finaliser over seed + (position + 1) x the golden
    ratio, so neighbouring positions and seeds give unrelated draws."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution p for sampling.

    logits: [..., V] (any float dtype); returns float32 probabilities [..., V].
    Must not be called for greedy requests: greedy is argmax, not a distribution.
    """
    assert not params.greedy, "greedy requests use argmax"
    import torch

    x = finite_logits(logits)
    # Less the row's maximum first: a +inf logit (the largest float after finite_logits) divided by a
    # temperature below 1 would overflow back to inf, and softmax would turn the row into NaN.
    x = x - x.max(-1, keepdim=True).values
    # Both cuts rank the logits before the division: at a high temperature, logits a few ulps apart divide
    # to the same float, and a cut that ranked the quotients would keep both (top_k=1 would not be greedy).
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x / params.temperature, dim=-1)
    if params.top_p < 1.0:
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices
        sorted_p = probs.gather(-1, order)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class BadLogits(RuntimeError):
    """A row of logits with no finite value: the step cannot sample from it (its requests fail, not the engine)."""


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN as -inf and +inf as the largest finite value, so NaN never reaches the sampler.
    Raises BadLogits when a row has nothing finite left."""
    import torch

    x = logits.float()
    if bool(torch.isfinite(x).all()):
        return x
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
    if not bool(torch.isfinite(x).any(-1).all()):
        raise BadLogits("the model produced no finite logit in a row")
    return x
