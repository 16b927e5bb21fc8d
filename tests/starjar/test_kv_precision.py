"""An int8 draft's KV cache precision: float32 unless its recipe or STARJAR_DRAFT_KV says float16; a float16
cache halves the draft's KV bytes and keeps greedy output the target's."""

import pytest
import torch
from int8_drafts import int8_draft_dir

from controller.colocated import colocated_engine
from starjar.errors import InvalidArgument
from starjar.model import kv_precision
from starjar.model.loading import kv_bytes_per_token, load_model
from starjar.spec.sampling import SamplingParams


@pytest.mark.parametrize("recipe,env,chosen", [(None, None, torch.float32), ("float16", None, torch.float16),
                                                ("float32", "float16", torch.float16), ("float16", "float32",
                                                                                       torch.float32)])
def test_float32_unless_the_recipe_or_the_environment_says_otherwise(monkeypatch, recipe, env, chosen):
    if env:
        monkeypatch.setenv(kv_precision.ENV, env)
    else:
        monkeypatch.delenv(kv_precision.ENV, raising=False)
    assert kv_precision.draft_kv_dtype(recipe) == chosen


def test_a_bad_forced_precision_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv(kv_precision.ENV, "int4")
    with pytest.raises(ValueError, match="float16"):
        kv_precision.draft_kv_dtype(None)


def test_a_forced_precision_keys_the_pair_measurement_apart(monkeypatch):
    from controller.tuning.pair_check import machine_fields
    from starjar.cpu.machine import machine_info

    monkeypatch.delenv(kv_precision.ENV, raising=False)
    plain = machine_fields(machine_info())
    assert "draft_kv_forced" not in plain  # a machine used as it is keys as before
    monkeypatch.setenv(kv_precision.ENV, "float16")
    assert machine_fields(machine_info())["draft_kv_forced"] == "float16"


@pytest.mark.parametrize("value", ["int8", 16, True, "Float16", "auto"])
def test_a_bad_kv_dtype_is_invalid_argument_naming_it(tmp_path, model_dirs, value):
    with pytest.raises(InvalidArgument, match="kv_dtype"):
        load_model(int8_draft_dir(tmp_path, model_dirs["llama"], kv_dtype=value), what="draft")


def test_float16_kv_needs_the_lean_forward(tmp_path, model_dirs):
    with pytest.raises(InvalidArgument, match="kv_dtype other than float32"):
        load_model(int8_draft_dir(tmp_path, model_dirs["gpt2"], kv_dtype="float16"), what="draft")
    assert load_model(int8_draft_dir(tmp_path / "f32", model_dirs["gpt2"], kv_dtype="float32")).kv_dtype is None


def test_a_float16_draft_cache_halves_its_bytes_and_keeps_greedy_output_the_targets(
        tmp_path, models, model_dirs, prompt_ids, reference, monkeypatch):
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
    outs = [r.output_ids for r in eng.generate(prompt_ids[:8], SamplingParams(max_tokens=48))]
    assert outs == reference("llama", 48)[:8]
    assert eng.stats.acceptance_rate > 0.5
