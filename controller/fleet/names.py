"""The Ray actor names of the draft servers and target workers (found by name across restarts)."""

from __future__ import annotations

DRAFT = "starjar-draft"


def target_name(i: int) -> str:
    return f"starjar-target-{i}"


def draft_name(i: int) -> str:
    """The first draft server keeps the name it had when there was only one."""
    return DRAFT if i == 0 else f"{DRAFT}-{i}"


def is_draft_name(name: str) -> bool:
    return name == DRAFT or (name.startswith(DRAFT + "-") and name[len(DRAFT) + 1:].isdigit())
