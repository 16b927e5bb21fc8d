"""Typed errors shared by every component.

Each class says what went wrong in the caller's terms; `starjar.service.status` maps
each one to its gRPC status code in one table (this module imports no grpc).
An error may carry a machine-readable `reason` (e.g. "queue_full") and the
offending `field`: both travel to the caller as trailing metadata, so no one
has to parse a message to find them. An InvalidArgument always names the
field and the limit it broke, so the CLI, the servers and the HTTP endpoint
report it the same way, without a traceback.
"""

from __future__ import annotations


class StarjarError(Exception):
    """Base class of every error starjar raises on purpose."""

    reason: str | None = None  # machine-readable, e.g. "queue_full"
    field: str | None = None  # the request field at fault, when there is one


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


class ServiceError(StarjarError):
    """A server's answer to a call it will not (or could not) serve; the message is what the caller reads."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class NotFound(ServiceError):
    """What the call names does not exist (or is not the caller's to use)."""


class FailedPrecondition(ServiceError):
    """The call is well formed but the server is in no state to accept it (e.g. another tokenizer)."""


class ServerBusy(ServiceError):
    """A bounded queue or table is full; `reason` says which. Nothing was started: retry later."""


class NotServing(ServiceError):
    """The server cannot serve this now (draining, its engine stopped, no worker): try another or later."""


class BadCredentials(ServiceError):
    """The caller's token is missing or wrong."""


class TimedOut(ServiceError):
    """The request did not finish within its time limit."""


class InternalFailure(ServiceError):
    """A failure of the server's own, reported with a message that is safe to show."""


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
