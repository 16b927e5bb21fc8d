"""Settings and the flags that set them: a config's error about a field names the flag the user typed.

A flag is its setting's name with the unit suffix dropped and dashes for underscores (`drain_timeout_s`
is --drain-timeout).
"""

from __future__ import annotations

from starjar.errors import InvalidArgument


def flag_of(field: str) -> str:
    """The flag that sets a config field: draft_deadline_s -> --draft-deadline."""
    return "--" + field.removesuffix("_s").replace("_", "-")


def as_flag_error(exc: InvalidArgument) -> InvalidArgument:
    """A config's error about a field, reworded about its flag."""
    return InvalidArgument(flag_of(exc.field), exc.limit, exc.value)


def build_config(config_cls, **values):
    """config_cls(**values), an error about a field reworded about its flag."""
    try:
        return config_cls(**values)
    except InvalidArgument as exc:
        raise as_flag_error(exc) from None
