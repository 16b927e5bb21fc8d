"""Typed errors shared by every component.

An InvalidArgument always names the offending field and the limit it broke,
so the CLI, and later the gRPC interceptor, can report it without a traceback.
"""


class StarjarError(Exception):
    """Base class of every error starjar raises on purpose."""


class InvalidArgument(StarjarError, ValueError):
    """A caller-supplied value is out of bounds.

    field: the name the caller used (e.g. "max_tokens", "prompts[3].prompt").
    limit: the rule it broke, in words (e.g. "must be > 0").
    """

    def __init__(self, field: str, limit: str, value: object = None):
        self.field = field
        self.limit = limit
        self.value = value
        shown = "" if value is None else f" (got {_short(value)})"
        super().__init__(f"invalid {field}: {limit}{shown}")


class ModelMismatch(InvalidArgument):
    """Draft and target do not share a tokenizer, so draft ids mean nothing to the target."""


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
