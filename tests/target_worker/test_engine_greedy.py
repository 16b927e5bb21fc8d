"""Greedy output through the engine equals the target decoding alone (HF generate), token for token."""

import pytest

from controller.colocated import colocated_engine
from draft_server.engine import DraftEngine
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from target_worker.engine import EngineConfig, TargetEngine

GREEDY = SamplingParams(max_tokens=64)


def outputs(reqs):
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("batch_size", [1, 4, 16])
@pytest.mark.parametrize("gamma", [0, 1, 2, 3, 4, 5])
def test_llama_40_own_prompts(models, prompt_ids, reference, batch_size, gamma):
    engine = colocated_engine(models["llama"], models["draft"], gamma, batch_size)
    reqs = engine.generate(prompt_ids, GREEDY)
    assert outputs(reqs) == reference("llama")
    if gamma:
        assert engine.stats.drafted_tokens > 0
        assert 0 < engine.stats.acceptance_rate < 1  # the tiny draft is good but not perfect


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
@pytest.mark.parametrize("batch_size,gamma", [(1, 3), (4, 1), (16, 5)])
def test_other_families(models, prompt_ids, reference, family, batch_size, gamma):
    # The llama draft shares the tokenizer; its guesses are poor for these targets, which
    # exercises rejection at every position.
    engine = colocated_engine(models[family], models["draft"], gamma, batch_size)
    assert outputs(engine.generate(prompt_ids, GREEDY)) == reference(family)


def test_self_draft_accepts_everything(models, prompt_ids, reference):
    """The target as its own draft: every draft accepted, bonus tokens, same output."""
    engine = colocated_engine(models["llama"], models["llama"], 4, 8)
    assert outputs(engine.generate(prompt_ids[:8], GREEDY)) == reference("llama")[:8]
    assert engine.stats.acceptance_rate == 1.0


def test_arrivals_mid_run_and_mixed_lengths(models, prompt_ids, reference):
    """Requests join and leave at every step; max_tokens differ per request."""
    engine = colocated_engine(models["llama"], models["draft"], 3, 6)
    ref = reference("llama")
    reqs, pending = [], list(range(20))
    while pending or engine.has_work():
        for _ in range(2):
            if pending:
                i = pending.pop(0)
                reqs.append((i, engine.add_request(prompt_ids[i], SamplingParams(max_tokens=8 + 2 * i))))
        engine.step()
    for i, r in reqs:
        assert r.output_ids == ref[i][: 8 + 2 * i]
        assert r.finish_reason == ("stop" if len(ref[i]) <= 8 + 2 * i and ref[i][-1] == 2 else "length")


def test_kv_budget_preempts_and_stays_exact(models, prompt_ids, reference):
    engine = colocated_engine(models["llama"], models["draft"], 4, 16, kv_budget_tokens=700)
    assert outputs(engine.generate(prompt_ids[:16], GREEDY)) == reference("llama")[:16]
    assert engine.stats.preemptions > 0
    assert engine.cache.tokens_used() == 0 and engine.proposer.num_sequences == 0


def test_stop_token_ids(models, prompt_ids, reference):
    ref = reference("llama")[0]
    stop = ref[10]
    engine = colocated_engine(models["llama"], models["draft"], 3, 4)
    r = engine.generate([prompt_ids[0]], SamplingParams(max_tokens=64, stop_token_ids=[stop]))[0]
    assert r.output_ids == ref[: ref.index(stop) + 1] and r.finish_reason == "stop"


class FlakyProposer:
    """Fault injection around a real draft engine: raise, resync, garbage, short answers."""

    def __init__(self, inner, vocab):
        self.inner, self.vocab, self.calls = inner, vocab, 0

    def propose(self, reqs):
        self.calls += 1
        mode = self.calls % 5
        if mode == 0:
            raise ConnectionError("draft server went away")
        replies = self.inner.propose(reqs)
        if mode == 1:
            return [None] * len(replies)  # resync everything
        if mode == 2:
            return [[self.vocab + 5] * len(r) if r else r for r in replies]  # ids outside the vocabulary
        if mode == 3:
            return replies[:-1]  # a malformed reply
        return replies

    def release(self, ids):
        if self.calls % 7 == 0:
            raise ConnectionError("release lost")
        self.inner.release(ids)


def test_failing_proposer_never_changes_output(models, prompt_ids, reference):
    proposer = FlakyProposer(DraftEngine(models["draft"]), models["llama"].vocab_size)
    engine = TargetEngine(models["llama"], proposer, FixedGamma(3), EngineConfig(max_batch_size=8))
    assert outputs(engine.generate(prompt_ids, GREEDY)) == reference("llama")
    s = engine.stats
    assert s.proposer_failures > 0 and s.resyncs > 0 and s.accepted_tokens > 0


def test_sampled_runs_repeat_with_a_seed(models, prompt_ids):
    p = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=i) for i in range(6)]
    a = colocated_engine(models["llama"], models["draft"], 3, 4).generate(prompt_ids[:6], p)
    b = colocated_engine(models["llama"], models["draft"], 3, 2).generate(prompt_ids[:6], p)
    assert outputs(a) == outputs(b)


def test_seeded_sampled_output_is_the_target_alones_whatever_the_draft_does(models, prompt_ids):
    """A seeded sampled request outputs the same tokens with no draft, a working draft, or a flaky one (failures,
    garbage and resyncs): the draws belong to positions, not to how many draws a step took (before, a step with
    drafts took gamma + 1 draws and a step without took one, so every later token moved)."""
    p = [SamplingParams(max_tokens=32, temperature=0.9, top_k=50, seed=100 + i) for i in range(6)]
    alone = colocated_engine(models["llama"], None, 0, 4).generate(prompt_ids[:6], p)
    drafted = colocated_engine(models["llama"], models["draft"], 3, 4)
    flaky = TargetEngine(models["llama"], FlakyProposer(DraftEngine(models["draft"]), models["llama"].vocab_size),
                         FixedGamma(3), EngineConfig(max_batch_size=4))
    assert outputs(drafted.generate(prompt_ids[:6], p)) == outputs(alone)
    assert outputs(flaky.generate(prompt_ids[:6], p)) == outputs(alone)
    assert drafted.stats.accepted_tokens > 0 and flaky.stats.proposer_failures > 0


def test_step_outputs_snapshot_finished(models, prompt_ids):
    """A consumer reading an older step's output must not see the request's later state
    (a streaming server once ended a stream one step early because of that)."""
    engine = colocated_engine(models["llama"], None, 0, 2)
    req = engine.add_request(prompt_ids[0], SamplingParams(max_tokens=3, ignore_eos=True))
    seen = []
    while engine.has_work():
        seen.extend(engine.step())
    assert [o.finished for o in seen] == [False, False, True]
    assert sum(len(o.new_token_ids) for o in seen) == 3 and req.finished
