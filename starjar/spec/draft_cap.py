"""A request's own cap on speculation: the most draft tokens verified for it in one step.

A caller sends it as `speculation = {"max_draft_tokens": k}` (the SDK, the OpenAI body) or as the request's
`Speculation` message (the wire). k = 0 has the target decode the request alone; no cap leaves gamma to the
server's policy. The cap only narrows what the policy chose (min of the two), so it never changes the output.
Every entry point checks it here, with the same field name and limit in every refusal.
"""

from __future__ import annotations

from collections.abc import Mapping

from starjar.errors import InvalidArgument

# The most drafts one sequence may have verified in a step: the engine's ceiling on gamma (and a token
# tree's depth); a larger cap could never bind.
MAX_DRAFT_TOKENS = 16
FIELD = "speculation.max_draft_tokens"
KEYS = ("max_draft_tokens",)


def check_max_draft_tokens(value: object) -> int:
    """The cap as an int; InvalidArgument (naming the field and its limit) for anything but an integer in
    [0, MAX_DRAFT_TOKENS]."""
    limit = f"must be an integer in [0, {MAX_DRAFT_TOKENS}] (0: no speculation)"
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DRAFT_TOKENS:
        raise InvalidArgument(FIELD, limit, value)
    return value


def draft_cap_from_mapping(spec: object) -> int | None:
    """A caller's `speculation` object ({"max_draft_tokens": k}); None when absent or k is null. Keys other
    than max_draft_tokens are refused, so a misspelt one is not silently ignored."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise InvalidArgument("speculation", 'must be an object, e.g. {"max_draft_tokens": 4}', spec)
    unknown = [k for k in spec if k not in KEYS]
    if unknown:
        raise InvalidArgument("speculation", f"unknown key; the only key is {KEYS[0]}", unknown[0])
    value = spec.get(KEYS[0])
    return None if value is None else check_max_draft_tokens(value)
