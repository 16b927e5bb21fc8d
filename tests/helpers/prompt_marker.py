"""Looking for a prompt's random marker where no prompt text may go: every log and file a run left. The traffic
puts the marker through every SDK path that handles text."""

from __future__ import annotations

from pathlib import Path

import pytest

from starjar import Client, InvalidRequest


def files_with_marker(marker: str, *roots: Path) -> list[str]:
    """Every regular file under the roots (or the root itself, a file) that holds the marker, as bytes."""
    needle = marker.encode()
    found = []
    for root in roots:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
        for path in files:
            try:
                if needle in path.read_bytes():
                    found.append(str(path))
            except OSError:  # a socket, or a file removed while we looked
                continue
    return found


def sdk_traffic(address: str, marker: str) -> int:
    """Every SDK path with the marker in its prompt; how many requests were sent."""
    prompt = f"Tell me about {marker}, please."
    with Client(address, timeout=120) as c:
        assert c.generate(prompt, max_tokens=16).usage.completion_tokens > 0
        assert len(list(c.generate_stream(prompt, max_tokens=16))) > 0
        assert c.generate(prompt, max_tokens=16, chat=True).usage.completion_tokens > 0
        stream = c.generate_stream(prompt, max_tokens=200, ignore_eos=True)
        next(stream)
        stream.close()  # the caller walks away mid-stream
        with pytest.raises(InvalidRequest):
            c.generate(f"{marker} " * 400, max_tokens=4)  # too long for the model
        with pytest.raises(InvalidRequest):
            c.generate(prompt, max_tokens=4, model=f"no-such-model-{marker}")
    return 6
