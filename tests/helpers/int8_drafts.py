"""Int8 draft directories as `starjar models build` writes them, made from a tiny target."""

from __future__ import annotations

import json
import shutil


def int8_draft_dir(tmp_path, target_dir, **recipe):
    """A draft directory as `starjar models build` writes it: tokenizer and config, weights from the target."""
    d = tmp_path / "int8-draft"
    shutil.copytree(target_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    (d / "starjar.json").write_text(json.dumps({"kind": "dynamic-int8", "weights_from": str(target_dir), **recipe}))
    return d
