"""The prompt check of a request entering a target worker: ints, not empty, within the context, in the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

from starjar.errors import InvalidArgument
from starjar.spec.token_ids import check_token_ids


def check_prompt(prompt_ids: Sequence[int], limit: int, context: int, vocab_size: int) -> list[int]:
    """The prompt as ints; InvalidArgument past `limit` tokens (the context less one token to generate)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise InvalidArgument("prompt", "must contain at least 1 token")
    if len(prompt) > limit:
        raise InvalidArgument("prompt", f"at most {limit} tokens (context {context}, one token left to generate)",
                              f"{len(prompt)} tokens")
    check_token_ids("prompt_token_ids", prompt, vocab_size)
    return prompt
