"""Flags that set a server config's fields: declared here once, defaults read from the dataclass.

`starjar serve draft` and `starjar up` take the same draft-server flags; `up` also takes the HTTP port's
limits. A flag left out is left out of the overrides, so the dataclass default is the only default.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from controller.cluster.settings import flag_of
from draft_server.lookahead import MODES as LOOKAHEAD_MODES

# field -> (type, help); the help gets the dataclass default appended.
DRAFT_SERVER_FLAGS = {
    "max_batch_rounds": (int, "batched mode: most rounds drafted together; the rest wait for a place. Below N_max it "
                              "staggers the targets, so that some draft while others verify"),
    "max_targets_per_caller": (int, "sessions one caller (client certificate subject and host) may hold; past it "
                                    "Attach is refused, reason caller. Without mutual TLS every target on one host "
                                    "is one caller: set it to the most targets one host runs"),
    "reclaim_after_s": (float, "seconds after which an Attach under a live session's worker id replaces it (a "
                               "restarted target gets its slot back); from another caller, only once that "
                               "session has been this long without a round"),
    "pass_catchup_tokens": (int, "prompt and resync tokens one draft pass feeds, shared fairly between targets: "
                                 "how long one target's prompts may keep another's drafts waiting"),
    "lookahead": (LOOKAHEAD_MODES, "chain: while no round waits, draft each answered round's likeliest next round "
                                   "(every draft accepted, the bonus token guessed); a round that matches is "
                                   "answered from it. fanout: with the idle time left, also its likeliest "
                                   "rejections (the draft's runner-up as the correction). Real rounds always go "
                                   "first"),
}
HTTP_FLAGS = {
    "header_timeout_s": (float, "OpenAI port: seconds to the end of a request's headers (idle keep-alive "
                                "connections close after it too)"),
    "body_timeout_s": (float, "OpenAI port: seconds from the headers to the end of the body; then 408"),
    "max_body_bytes": (int, "OpenAI port: the largest request body; a larger Content-Length is a 413, unread"),
}


def _default(config_cls, name: str):
    field = next(f for f in fields(config_cls) if f.name == name)
    return field.default if field.default is not MISSING else field.default_factory()


def add_config_flags(parser, config_cls, flags: dict, title: str | None = None) -> None:
    """One flag per field in `flags` (see flag_of), default None: unset leaves the dataclass's default."""
    group = parser.add_argument_group(title) if title else parser
    for name, (kind, text) in flags.items():
        default = _default(config_cls, name)
        shown = "unset" if default is None else default
        # kind: a type, or a tuple of the strings the field takes ({a,b} in the help)
        how = dict(choices=kind) if isinstance(kind, tuple) else dict(
            type=kind, metavar="SECONDS" if name.endswith("_s") else "N")
        group.add_argument(flag_of(name), dest=name, default=None, **how,
                           help=f"{text} (default {shown})".replace("%", "%%"))


def config_overrides(args: argparse.Namespace, flags: dict) -> dict:
    """The fields whose flags were given."""
    return {name: getattr(args, name) for name in flags if getattr(args, name, None) is not None}
