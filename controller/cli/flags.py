"""What every command's flags share: one name per setting, and the old spellings kept working.

A flag is its setting's name with the unit suffix dropped and dashes for underscores (`drain_timeout_s`
is --drain-timeout), so an error a config raises for a field names the flag the user typed.
"""

from __future__ import annotations

import argparse
import sys

from starjar.errors import InvalidArgument
from starjar.spec.tree_select import TREE_CHOICES, TREE_MAX_DEPTH, trees_on


def check_output_path(flag: str, path: str) -> None:
    """Before any work: the file a command writes at its end can be written (its folder exists, it is not a
    folder), so minutes of results are not lost to a typo."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InvalidArgument(flag, "must be a file path, not a folder", path)
    if not os.path.isdir(folder):
        raise InvalidArgument(flag, "its folder must exist", path)
    if not os.access(folder, os.W_OK):
        raise InvalidArgument(flag, "its folder must be writable", path)


def check_port(flag: str, port: int | None) -> None:
    if port is not None and not 0 <= port <= 65535:
        raise InvalidArgument(flag, "must be in [0, 65535] (0 = any free port)", port)


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kw) -> None:
    """`old` still sets `dest` (hidden from --help) and warns that `new` is its name now; kw: as `new`'s
    (type=int, ...)."""

    class _Warn(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"starjar: warning: {old} is deprecated, use {new}", file=sys.stderr)
            setattr(namespace, self.dest, values)

    parser.add_argument(old, dest=dest, action=_Warn, help=argparse.SUPPRESS, **kw)


def add_tree_flags(parser: argparse.ArgumentParser) -> None:
    """--tree and its knobs, the same on `serve target` and `up`."""
    g = parser.add_argument_group("token trees (AdaServe; README: How the engine works)")
    g.add_argument("--tree", default=None, choices=TREE_CHOICES, metavar="{" + ",".join(TREE_CHOICES) + "}",
                   help="verify token trees instead of chains, nodes chosen under the verification budget by: "
                        "adaserve (requests behind their TPOT SLO first, then throughput), global_greedy (best "
                        "nodes of all trees), equal_greedy (the budget split equally), fixed (SpecInfer's fixed "
                        "shape); chain = today's chains, no trees (the default); none = no speculation")
    g.add_argument("--tree-width", type=int, default=3,
                   help="W_max: the draft's beam width, candidates per node (default 3; the batch narrows it)")
    g.add_argument("--tree-cap", type=int, default=16, help="most tree nodes one sequence verifies per step "
                   "(default 16); the depth is at most --gamma (default with trees: "
                   f"{TREE_MAX_DEPTH}) and the budget over the batch")
    g.add_argument("--tree-budget", type=int, default=None,
                   help="tokens one target pass verifies, every sequence's pending token included (default: "
                        "verify_budget of --profile, written by `starjar profile`, else measured at start)")


def tree_speculation(tree: str | None, gamma: int | None, policy: str | None) -> tuple[int | None, str | None]:
    """(gamma, policy) as --tree changes them: none = gamma 0; a tree policy without --gamma = fixed depth
    TREE_MAX_DEPTH (trees choose their depth from the budget, below it; chains' measured gamma is no guide)."""
    if tree == "none":
        if gamma:
            raise InvalidArgument("--tree", "none (no speculation) cannot go with --gamma > 0", tree)
        return 0, "fixed"
    if trees_on(tree) and gamma is None and policy in (None, "fixed"):
        return TREE_MAX_DEPTH, "fixed"
    return gamma, policy
