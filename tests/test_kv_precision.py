"""An int8 draft's KV cache precision: float16 where it measures clearly faster here (or forced), float32
otherwise; a float16 cache halves the draft's KV bytes and keeps greedy output the target's."""

import json

import pytest
import torch

from controller.colocated import colocated_engine
from starjar import kv_precision
from starjar.errors import InvalidArgument
from starjar.models import kv_bytes_per_token, load_model
from starjar.sampling import SamplingParams
from tests.test_lean_decoder import int8_draft_dir


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("starjar.kernels._entries", {})
    monkeypatch.delenv(kv_precision.ENV, raising=False)
    return tmp_path / "home" / "kernels.json"


@pytest.mark.parametrize("ms16,chosen", [(5.0, torch.float16), (9.4, torch.float16), (9.8, torch.float32),
                                         (20.0, torch.float32)])
def test_auto_keeps_float16_only_when_clearly_faster_and_caches_the_choice(fresh_cache, monkeypatch, ms16, chosen):
    monkeypatch.setattr(kv_precision, "time_attention", lambda *a: {"float32": 10.0, "float16": ms16})
    assert kv_precision.draft_kv_dtype(None, 2, 2, 4, 16) == chosen
    entry = next(v for k, v in json.loads(fresh_cache.read_text()).items() if f"|{kv_precision.KIND}|" in k)
    assert entry["ms"] == {"float32": 10.0, "float16": ms16}
    monkeypatch.setattr(kv_precision, "time_attention", lambda *a: pytest.fail("measured twice"))
    monkeypatch.setattr("starjar.kernels._entries", {})  # a new process: read from the file, not measured
    assert kv_precision.draft_kv_dtype(None, 2, 2, 4, 16) == chosen


@pytest.mark.parametrize("name", sorted(kv_precision.KV_DTYPES))
def test_a_forced_or_recipe_precision_is_not_measured(fresh_cache, monkeypatch, name):
    monkeypatch.setattr(kv_precision, "time_attention", lambda *a: pytest.fail("a forced precision is not measured"))
    assert kv_precision.draft_kv_dtype(name, 2, 2, 4, 16) == kv_precision.KV_DTYPES[name]
    monkeypatch.setenv(kv_precision.ENV, name)
    assert kv_precision.draft_kv_dtype("float32", 2, 2, 4, 16) == kv_precision.KV_DTYPES[name]  # env wins


def test_the_real_measurement_times_both_precisions():
    ms = kv_precision.time_attention(2, 2, 4, 16, rows=2, keys=32, reps=1)
    assert set(ms) == set(kv_precision.KV_DTYPES) and all(v > 0 for v in ms.values())


@pytest.mark.parametrize("value", ["int8", 16, True, "Float16"])
def test_a_bad_kv_dtype_is_invalid_argument_naming_it(tmp_path, model_dirs, value):
    with pytest.raises(InvalidArgument, match="kv_dtype"):
        load_model(int8_draft_dir(tmp_path, model_dirs["llama"], kv_dtype=value), what="draft")


def test_float16_kv_needs_the_lean_forward(tmp_path, model_dirs):
    with pytest.raises(InvalidArgument, match="kv_dtype other than float32"):
        load_model(int8_draft_dir(tmp_path, model_dirs["gpt2"], kv_dtype="float16"), what="draft")
    assert load_model(int8_draft_dir(tmp_path / "f32", model_dirs["gpt2"], kv_dtype="float32")).kv_dtype is None


def test_a_float16_draft_cache_halves_its_bytes_and_keeps_greedy_output_the_targets(
        tmp_path, models, model_dirs, spec_prompts, reference, monkeypatch):
    monkeypatch.delenv(kv_precision.ENV, raising=False)
    half = load_model(int8_draft_dir(tmp_path / "half", model_dirs["llama"], kv_dtype="float16"), what="draft")
    full = load_model(int8_draft_dir(tmp_path / "full", model_dirs["llama"], kv_dtype="float32"), what="draft")
    assert (half.kv_dtype, full.kv_dtype) == (torch.float16, torch.float32)
    assert 2 * kv_bytes_per_token(half) == kv_bytes_per_token(full)
    # One ragged pass and one-token steps through both: the float16 cache holds float16, logits stay close.
    logits = []
    for draft in (half, full):
        cache = draft.new_cache()
        slots = [cache.allocate() for _ in range(3)]
        out = draft.forward(cache, slots, [[5, 6, 7, 8], [9, 10], [11, 12, 13]], [[3], [1], [2]])
        for t in range(3):
            out += draft.forward(cache, slots, [[20 + t], [30 + t], [40 + t]], [[0]] * 3)
        assert cache._keys[0].dtype == draft.kv_dtype
        logits.append(torch.cat(out))
    assert not torch.equal(logits[0], logits[1])  # the precision is really used
    assert (logits[0] - logits[1]).norm() < 0.05 * logits[1].norm()  # int8 activations amplify a rounding
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9
    eng = colocated_engine(models["llama"], half, 3, 8)
    outs = [r.output_ids for r in eng.generate(spec_prompts[:8], SamplingParams(max_tokens=48))]
    assert outs == reference("llama", 48)[:8]
    assert eng.stats.acceptance_rate > 0.5
