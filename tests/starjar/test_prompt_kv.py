"""A co-located int8 copy of the target takes each prompt's KV from the target's prefill (starjar.model.prompt_kv)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from int8_drafts import int8_draft_dir, prefilled

from controller.colocated import colocated_engine
from starjar.model.kv_cache import RaggedKVCache
from starjar.model.loading import load_model
from starjar.model.prompt_kv import prompt_kv_shared, seeder
from starjar.spec.sampling import SamplingParams


@pytest.fixture(scope="module")
def smoothed(tmp_path_factory, model_dirs):
    return load_model(int8_draft_dir(tmp_path_factory.mktemp("seed"), model_dirs["llama"], smooth_alpha=0.5))


def test_a_prefix_moves_between_caches_in_the_new_dtype(models, prompt_ids):
    src, slot = prefilled(models["llama"], prompt_ids[0])
    n = len(prompt_ids[0]) - 3
    dst = RaggedKVCache(dtype=torch.float16, initial_capacity=8)
    other = dst.allocate()
    assert dst.load_prefix(other, src.prefix(slot, n))
    assert dst.lengths == [n]
    for (k, v), (k2, v2) in zip(src.prefix(slot, n), dst.prefix(other, n), strict=True):
        assert k2.dtype == torch.float16
        torch.testing.assert_close(k2.float(), k, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(v2.float(), v, atol=2e-3, rtol=2e-3)
    small = RaggedKVCache(initial_capacity=8, max_cells=n - 1)  # no room for n positions: nothing written
    assert not small.load_prefix(small.allocate(), src.prefix(slot, n))
    assert small.lengths == [0]


def test_only_an_int8_copy_of_the_target_itself_shares_its_kv(models, model_dirs, smoothed, tmp_path):
    assert prompt_kv_shared(models["llama"], smoothed)
    assert not prompt_kv_shared(models["qwen2"], smoothed)  # another model's weights
    assert not prompt_kv_shared(models["llama"], models["llama"])  # a float draft prefills itself
    assert not prompt_kv_shared(models["llama"], dataclasses.replace(smoothed, prompt_window=16))
    skipping = load_model(int8_draft_dir(tmp_path, model_dirs["llama"], skip_layers=[1]))
    assert not prompt_kv_shared(models["llama"], skipping)


def test_the_seeded_kv_is_what_the_smoothed_draft_would_compute(models, smoothed, prompt_ids):
    ids = prompt_ids[1]
    own, own_slot = prefilled(smoothed, ids)
    target, slot = prefilled(models["llama"], ids)
    taken = []
    seed = seeder(smoothed, lambda key, tokens, layers: taken.extend(layers) or True)
    assert seed("s", ids, target.prefix(slot, len(ids)))
    for (k, v), (k_own, v_own), (_, v_raw) in zip(taken, own.prefix(own_slot, len(ids)),
                                                 target.prefix(slot, len(ids)), strict=True):
        assert (k - k_own).norm() < 0.1 * k_own.norm()
        assert (v - v_own).norm() < 0.1 * v_own.norm()
        assert (v_raw - v_own).norm() > 0.3 * v_own.norm()  # unscaled, the values would be another model's


def test_a_seeded_draft_is_lossless_and_skips_the_prompts_prefill(models, smoothed, prompt_ids, reference):
    prompts = prompt_ids[:8]
    runs = {}
    for seeded in (True, False):
        eng = colocated_engine(models["llama"], smoothed, 3, 4)
        if not seeded:
            eng.seed_draft = None
        outs = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=32))]
        assert outs == reference("llama", 32)[:8]
        runs[seeded] = (eng.proposer.stats, eng.stats.acceptance_rate)
    (seeded, acc), (own, acc_own) = runs[True], runs[False]
    assert seeded.seeded_tokens == sum(map(len, prompts)) and own.seeded_tokens == 0
    assert seeded.catchup_tokens < own.catchup_tokens - sum(map(len, prompts)) // 2
    assert acc > acc_own - 0.1, (acc, acc_own)


def test_a_seeded_prompt_is_no_catch_up_for_the_policy(models, smoothed, prompt_ids):
    eng = colocated_engine(models["llama"], smoothed, 3, 4)
    seeded = eng.add_request(prompt_ids[0], SamplingParams(max_tokens=16))
    eng.step()  # the prefill: its first token is the only one the draft has not seen
    assert seeded.draft_synced == len(prompt_ids[0]) and seeded.draft_lag() == 1
    eng.seed_draft = None
    own = eng.add_request(prompt_ids[1], SamplingParams(max_tokens=16))
    eng.step()
    assert own.draft_lag() == len(prompt_ids[1]) + 1  # the draft must still read the whole prompt


def test_a_request_without_drafts_is_not_seeded(models, smoothed, prompt_ids, reference):
    eng = colocated_engine(models["llama"], smoothed, 3, 4)
    req = eng.add_request(prompt_ids[0], SamplingParams(max_tokens=16), max_draft_tokens=0)
    while eng.has_work():
        eng.step()
    assert req.output_ids == reference("llama", 16)[0]
    assert eng.proposer.stats.seeded_tokens == 0 and eng.proposer.num_sequences == 0
