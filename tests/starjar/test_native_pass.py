"""The native target passes (starjar.model.native_pass): the scripted layers' bits, chosen or forced."""

import json
import os
import subprocess
import sys

import pytest
import torch
from exact_fusion import needs_exact_fusion

from controller.colocated import colocated_engine
from starjar.cpu import kernels, skinny_linear
from starjar.model import lean_choices, lean_target, native_pass
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams


def _steps(model, prompts: list[list[int]], steps: int = 12) -> list[torch.Tensor]:
    """Logits of a prefill per prompt and then one-token steps at batch 1, each in its own fresh cache."""
    out = []
    for prompt in prompts:
        cache = model.new_cache()
        slot = cache.allocate()
        out += model.forward(cache, [slot], [prompt], [[len(prompt) - 1]])
        for tok in range(3, 3 + steps):
            out += model.forward(cache, [slot], [[tok]], [[0]])
    return out


def _chain_passes(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of the multi-row passes the engines make: a short prefill, verification over 4 positions (batch 3
    and 1), one-token steps of 3 rows, and, scripted, rows of unequal lengths and rows on scattered slots."""
    cache = model.new_cache()
    slots = [cache.allocate() for _ in range(4)]
    out = model.forward(cache, slots[:3], [p[:20] for p in prompts[:3]], [[19]] * 3)
    out += model.forward(cache, slots[3:], [prompts[3][:6]], [list(range(6))])
    out += model.forward(cache, slots[:3], [[7, 8, 9, 10]] * 3, [[0, 1, 2, 3]] * 3)
    out += model.forward(cache, slots[:3], [[11]] * 3, [[0]] * 3)
    out += model.forward(cache, slots[:1], [[3, 4, 5, 6]], [[0, 1, 2, 3]])  # rows of unequal lengths from here
    out += model.forward(cache, slots[:3], [[12, 13], [14], [15, 16]], [[0, 1], [0], [0, 1]])
    out += model.forward(cache, [slots[0], slots[2]], [[17], [18]], [[0], [0]])
    return out


def _hf_then_native(model, prompts, passes, monkeypatch) -> tuple[list, list]:
    """passes(model, prompts) with HF's forward, then lean with the native pass forced."""
    monkeypatch.setenv(lean_target.ENV, "0")
    hf = passes(model, prompts)
    monkeypatch.setenv(lean_target.ENV, "1")
    monkeypatch.setenv(native_pass.ENV, "1")
    return hf, passes(model, prompts)


def _count_native(monkeypatch) -> list:
    calls = []
    run = native_pass.run
    monkeypatch.setattr(native_pass, "run", lambda *a: calls.append(a[0].shape[:2]) or run(*a))
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_native_passes_equal_hf_and_scripted_bitwise(models, prompt_ids, monkeypatch, family):
    """Forced native, forced scripted and HF's forward give the same logits to the last bit (qwen2: biased
    q/k/v), and each forced way is the one that ran."""
    model = models[family]
    assert native_pass.available(), native_pass.unavailable_reason()
    needs_exact_fusion(model)
    calls = _count_native(monkeypatch)
    monkeypatch.setenv(native_pass.ENV, "0")
    monkeypatch.setenv(lean_target.ENV, "1")
    scripted = _steps(model, prompt_ids[:3])
    assert calls == []
    hf, native = _hf_then_native(model, prompt_ids[:3], _steps, monkeypatch)
    assert calls.count((1, 1)) == 3 * 12
    for a, b, c in zip(hf, scripted, native, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), (a - c).abs().max()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("path", ["linear", "wxt", "packed", "rows"])
def test_native_chain_passes_equal_hf_bitwise(model_dirs, prompt_ids, monkeypatch, family, path):
    """Verification, multi-row and ragged passes natively (rows of unequal lengths on consecutive slots write
    each token where the cache says), by each product skinny_linear may install (qwen2: biased q/k/v): HF's bits;
    scattered slots stay scripted."""
    monkeypatch.setenv(skinny_linear.ENV, path)
    monkeypatch.setenv(lean_target.ENV, "1")
    model = load_model(model_dirs[family])
    needs_exact_fusion(model)
    model.lean_target.fused_rows = [True] * len(skinny_linear.BUCKETS)  # every bucket fused: where it runs
    calls = _count_native(monkeypatch)
    hf, native = _hf_then_native(model, prompt_ids[:4], _chain_passes, monkeypatch)
    assert (1, 4) in calls and (3, 4) in calls and (3, 1) in calls and (3, 2) in calls and (2, 1) not in calls
    for a, b in zip(hf, native, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def _flash_calls(run) -> tuple[object, int]:
    """run()'s result and how many times it called ATen's CPU flash attention."""
    from torch.profiler import profile

    with profile() as prof:
        out = run()
    return out, sum(e.key == "aten::_scaled_dot_product_flash_attention_for_cpu" for e in prof.key_averages()
                    for _ in range(e.count))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_long_passes_attend_in_key_blocks_with_hf_bits(tmp_path, monkeypatch, family):
    """Prefills past the flash kernel's key block (one from nothing, one past a cached prefix), natively: query
    rows in chunks, each over the key blocks it may see, and still HF's bits at the rows on either side of a
    block's edge."""
    from benchmarks.fixtures.tiny_models import make_tiny_model

    model = load_model(make_tiny_model(tmp_path / family, family, seed=3, max_context=2048))
    needs_exact_fusion(model)
    model.lean_target.fused_rows = [True] * len(skinny_linear.BUCKETS)
    ids = [(7 * i) % 300 + 3 for i in range(1100)]

    def passes(m, _):
        cache = m.new_cache()
        a, b = cache.allocate(), cache.allocate()
        out = m.forward(cache, [a], [ids], [[0, 127, 511, 512, 900, 1099]])
        out += m.forward(cache, [b], [ids[:300]], [[299]])
        return out + m.forward(cache, [b], [ids[300:1000]], [[0, 211, 212, 699]])

    calls = _count_native(monkeypatch)
    hf, (native, flash) = _hf_then_native(model, None, lambda m, p: _flash_calls(lambda: passes(m, p)), monkeypatch)
    assert calls == [(1, 1100), (1, 300), (1, 700)]
    layers = model.model.config.num_hidden_layers
    assert flash > 3 * layers  # some pass attended in more than one call a layer
    for a, b in zip(hf[0], native, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_native_kv_writes_equal_scripted(models, prompt_ids, monkeypatch):
    """After the same steps, the cache holds the same keys and values either way."""
    model = models["llama"]
    monkeypatch.setenv(lean_target.ENV, "1")
    buffers = {}
    for way in ("0", "1"):
        monkeypatch.setenv(native_pass.ENV, way)
        cache = model.new_cache()
        slot = cache.allocate()
        model.forward(cache, [slot], [prompt_ids[4]], [[len(prompt_ids[4]) - 1]])
        for tok in (5, 6, 7, 8):
            model.forward(cache, [slot], [[tok]], [[0]])
        buffers[way] = [t[slot, :, : cache.lengths[slot]].clone() for t in (*cache._keys, *cache._values)]
    assert all(torch.equal(a, b) for a, b in zip(buffers["0"], buffers["1"], strict=True))


@pytest.mark.parametrize("native", ["0", "1"])
def test_engine_greedy_equals_reference_native_or_not(models, prompt_ids, reference, monkeypatch, native):
    """Target alone (batch 1) and speculative, with the step native or scripted: HF generate()'s tokens."""
    monkeypatch.setenv(lean_target.ENV, "1")
    monkeypatch.setenv(native_pass.ENV, native)
    for gamma in (0, 3):
        engine = colocated_engine(models["llama"], models["draft"] if gamma else None, gamma, 1)
        reqs = engine.generate(prompt_ids[:6], SamplingParams(max_tokens=64))
        assert [r.output_ids for r in reqs] == reference("llama")[:6]


def test_native_choice_measured_once_and_cached(model_dirs, monkeypatch, tmp_path):
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    monkeypatch.delenv(native_pass.ENV, raising=False)
    monkeypatch.delenv(lean_target.ENV, raising=False)
    monkeypatch.setattr(kernels, "_entries", {})
    model = load_model(model_dirs["llama"])
    assert set(model.lean_target.native) == {"step", "rows"}  # settled at load
    stored = json.loads((tmp_path / "kernels.json").read_text())
    entries = [e for name, e in stored.items() if lean_choices.NATIVE_KIND in name]
    assert len(entries) == 1 and entries[0]["native"] == model.lean_target.native
    assert set(entries[0]["ms"]) == {"step", "rows"} and set(entries[0]["ms"]["rows"]) == {"scripted", "native"}


_UNBUILDABLE = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from starjar.model import native_pass
from starjar.model.loading import load_model
model = load_model(sys.argv[1])
print("available", native_pass.available(), "native", model.lean_target.native["step"])
"""


def test_without_a_compiler_the_scripted_step_runs(model_dirs, tmp_path):
    """Where the step cannot be built (no compiler here), the model loads and steps scripted with a warning
    that says why; forced on, the load fails saying so."""
    env = dict(os.environ, CXX="/nonexistent/c++", STARJAR_NATIVE_DIR=str(tmp_path / "native"),
               STARJAR_HOME=str(tmp_path / "home"))
    env.pop(native_pass.ENV, None)
    run = subprocess.run([sys.executable, "-c", _UNBUILDABLE, str(model_dirs["llama"])], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "available False native False" in run.stdout
    assert "native passes unavailable, the scripted layers run" in run.stderr
    env[native_pass.ENV] = "1"
    run = subprocess.run([sys.executable, "-c", _UNBUILDABLE, str(model_dirs["llama"])], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and f"{native_pass.ENV}=1, but the native pass could not be built" in run.stderr


def test_every_native_source_ships_in_the_package():
    """A wheel builds the native passes on first use: every source and header must be in its package data."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["starjar"]
    shipped = {f.relative_to(root / "starjar").as_posix() for folder in ("model/native", "cpu/native")
               for f in (root / "starjar" / folder).iterdir()}
    assert shipped >= {"model/native/target_pass.cpp", "model/native/draft_pass.cpp", "model/native/pass_parts.h",
                       "cpu/native/few_rows.cpp"}
    assert [f for f in shipped if not any(fnmatch.fnmatch(f, p) for p in patterns)] == []
