"""The committed stubs match proto/ (drift fails CI)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_field_is_documented():
    """Each message field in the .proto files carries a comment line above it."""
    for proto in (ROOT / "proto").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        in_message = False
        for i, line in enumerate(lines):
            s = line.strip()
            if s.startswith("message "):
                in_message = True
            elif s == "}":
                in_message = False
            elif in_message and s.endswith(";") and "=" in s and not s.startswith("//"):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} undocumented field: {s}"
