"""What every command's flags share: one name per setting, and the old spellings kept working.

A flag is its setting's name with the unit suffix dropped and dashes for underscores (`drain_timeout_s`
is --drain-timeout), so an error a config raises for a field names the flag the user typed.
"""

from __future__ import annotations

import argparse
import sys

from starjar.errors import InvalidArgument


def flag_of(field: str) -> str:
    """The flag that sets a config field: draft_deadline_s -> --draft-deadline."""
    return "--" + field.removesuffix("_s").replace("_", "-")


def as_flag_error(exc: InvalidArgument) -> InvalidArgument:
    """A config's error about a field, reworded about its flag."""
    return InvalidArgument(flag_of(exc.field), exc.limit, exc.value)


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kw) -> None:
    """`old` still sets `dest` (hidden from --help) and warns that `new` is its name now; kw: as `new`'s
    (type=int, ...)."""

    class _Warn(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"starjar: warning: {old} is deprecated, use {new}", file=sys.stderr)
            setattr(namespace, self.dest, values)

    parser.add_argument(old, dest=dest, action=_Warn, help=argparse.SUPPRESS, **kw)
