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

if TYPE_CHECKING:  # torch loads on first use, so `import starjar` (the SDK) stays light
    import torch

# Upper bounds that keep a single request from monopolising a server.
MAX_TOKENS_LIMIT = 1 << 16
MAX_STOP_IDS = 64


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler. temperature 0 means greedy."""

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
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise InvalidArgument("temperature", "must be >= 0 (0 = greedy)", self.temperature)
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument("top_p", "must be in (0, 1]", self.top_p)
        if self.top_k < 0:
            raise InvalidArgument("top_k", "must be >= 0 (0 = disabled)", self.top_k)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument("seed", "must be in [0, 2^63)", self.seed)
        if len(self.stop_token_ids) > MAX_STOP_IDS:
            raise InvalidArgument("stop_token_ids", f"at most {MAX_STOP_IDS} ids", len(self.stop_token_ids))
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise InvalidArgument("stop_token_ids", f"ids must be in [0, {vocab_size})", t)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> "torch.Generator":
        """A private RNG per request: seeded runs repeat, unseeded ones never collide."""
        import torch

        gen = torch.Generator(device="cpu")
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        gen.manual_seed(seed)
        return gen


def logits_to_probs(logits: "torch.Tensor", params: SamplingParams) -> "torch.Tensor":
    """Target distribution p for sampling.

    logits: [..., V] (any float dtype); returns float32 probabilities [..., V].
    Must not be called for greedy requests: greedy is argmax, not a distribution.
    """
    assert not params.greedy, "greedy requests use argmax"
    import torch

    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
