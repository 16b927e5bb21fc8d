"""The int8 draft's native one-token step (starjar.model.native_draft): the scripted step's bits, chosen by
measurement or forced, and lossless through the engine."""

import pytest
import torch
from int8_drafts import int8_draft_dir

from controller.colocated import colocated_engine
from starjar.cpu import kernels
from starjar.model import native_draft, native_pass
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams


def _steps(draft, prompts: list[list[int]], native: bool | None, steps: int = 10) -> torch.Tensor:
    """Logits of a prefill and then one-token steps per prompt, each in its own fresh cache."""
    draft.lean.native_step.override = native
    try:
        out = []
        for prompt in prompts:
            cache = draft.new_cache()
            slot = cache.allocate()
            out += draft.forward(cache, [slot], [prompt], [[len(prompt) - 1]])
            for tok in range(3, 3 + steps):
                out += draft.forward(cache, [slot], [[tok]], [[0]])
        return torch.cat(out)
    finally:
        draft.lean.native_step.override = None


def _counted(monkeypatch) -> list:
    calls = []
    run = native_pass.run_draft
    monkeypatch.setattr(native_pass, "run_draft", lambda *a: calls.append(a[8]) or run(*a))
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_native_step_is_the_scripted_step_bit_for_bit(tmp_path, model_dirs, prompt_ids, monkeypatch, family):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    draft = load_model(int8_draft_dir(tmp_path, model_dirs[family]))
    assert native_pass.available(), native_pass.unavailable_reason()
    calls = _counted(monkeypatch)
    scripted = _steps(draft, prompt_ids[:3], False)
    assert calls == []
    native = _steps(draft, prompt_ids[:3], True)
    assert len(calls) == 30 and calls[0] == len(prompt_ids[0])  # every step, written after the prompt
    assert torch.equal(native, scripted)


def test_a_float16_cache_keeps_the_scripted_step(tmp_path, model_dirs, prompt_ids, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float16")
    monkeypatch.setenv(native_pass.ENV, "1")
    draft = load_model(int8_draft_dir(tmp_path, model_dirs["llama"]))
    calls = _counted(monkeypatch)
    _steps(draft, prompt_ids[:1], None, steps=3)
    assert calls == []


@pytest.mark.parametrize("way", ["0", "1"])
def test_greedy_output_with_the_step_forced_each_way_is_the_targets(tmp_path, models, model_dirs, prompt_ids,
                                                                     reference, monkeypatch, way):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv(native_pass.ENV, way)
    draft = load_model(int8_draft_dir(tmp_path, model_dirs["llama"]))
    calls = _counted(monkeypatch)
    eng = colocated_engine(models["llama"], draft, 3, 1)
    outs = [r.output_ids for r in eng.generate(prompt_ids[:4], SamplingParams(max_tokens=32))]
    assert outs == reference("llama", 32)[:4]
    assert (len(calls) > 0) == (way == "1")


def test_the_choice_is_measured_once_per_machine_and_cached(tmp_path, model_dirs, prompt_ids, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path / "home"))  # a kernel cache of its own
    monkeypatch.delenv(native_pass.ENV, raising=False)
    measured = []
    real = native_draft.NativeDraftStep._measure
    monkeypatch.setattr(native_draft.NativeDraftStep, "_measure",
                        lambda self, probe, reps=3: measured.append(1) or real(self, probe, reps))
    for _ in range(2):
        kernels._entries.clear()  # a new process reads the kept entry
        draft = load_model(int8_draft_dir(tmp_path / str(len(measured)), model_dirs["llama"]))
        _steps(draft, prompt_ids[:1], None, steps=2)
        assert draft.lean.native_step.chosen is not None
    assert measured == [1]
    entry = next(e for name, e in kernels.cached_entries().items() if native_draft.KIND in name)
    assert set(entry["ms"]) == {"scripted", "native"} and entry["native"] == draft.lean.native_step.chosen
