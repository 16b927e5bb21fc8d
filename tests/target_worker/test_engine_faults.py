"""No request can kill the engine. Temperatures too small to divide by are greedy, NaN never
reaches the sampler, and a step that raises fails only the requests in it; an engine that keeps failing turns
its worker NOT_SERVING."""

import threading
import time

import pytest
import torch

from benchmarks.fixtures.reference import hf_greedy
from controller.colocated import colocated_engine
from starjar.errors import InvalidArgument
from starjar.spec.sampling import BadLogits, PositionDraws, SamplingParams, finite_logits
from starjar.spec.verify import sample_next
from target_worker.runner import MAX_FAILED_STEPS, EngineRunner


def test_a_temperature_of_1e_39_is_greedy_and_does_not_raise(models, prompt_ids, reference):
    eng = colocated_engine(models["llama"], None, 0, 4)
    out = eng.generate(prompt_ids[:4], SamplingParams(max_tokens=16, temperature=1e-39))
    assert [r.output_ids for r in out] == [r[:16] for r in reference("llama", 16)[:4]]


def test_nan_and_inf_logits_never_reach_the_sampler():
    logits = torch.tensor([[0.5, float("nan"), 2.0, float("-inf")]])
    assert finite_logits(logits).isnan().sum() == 0
    draws = PositionDraws(0)
    for pos in range(50):  # NaN is never sampled, -inf never; a sampled step picks a real token
        assert sample_next(logits[0], SamplingParams(temperature=1.0), draws, pos) in (0, 2)
    assert sample_next(logits[0], SamplingParams(), None) == 2  # argmax ignores the NaN (torch's would not)
    with pytest.raises(BadLogits):
        finite_logits(torch.full((1, 4), float("nan")))


def test_top_k_past_the_wire_limit_names_the_field():
    with pytest.raises(InvalidArgument, match="top_k"):
        SamplingParams(top_k=2**40)


def _run(runner, prompt, params):
    done, outs = threading.Event(), []

    def on_output(out):
        outs.append(out)
        if out.finished:
            done.set()
    runner.submit(prompt, params, "r", on_output)
    assert done.wait(60)
    return outs


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(models, prompt_ids, reference):
    eng = colocated_engine(models["llama"], None, 0, 4)
    runner = EngineRunner(eng)
    forward, calls = eng.model.forward, {"n": 0}

    def flaky(*a, **k):  # fault injection: the second pass of the engine raises once
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return forward(*a, **k)

    eng.model = type(eng.model)(**{**eng.model.__dict__})
    object.__setattr__(eng.model, "forward", flaky)
    runner.start()
    try:
        first = _run(runner, prompt_ids[0], SamplingParams(max_tokens=8))
        assert first[-1].error and "RuntimeError" in first[-1].error and first[-1].request.finish_reason == "error"
        assert eng.cache.num_slots == 0  # its KV was freed
        second = _run(runner, prompt_ids[1], SamplingParams(max_tokens=8))  # the engine goes on
        assert second[-1].error is None
        assert [t for o in second for t in o.new_token_ids] == reference("llama")[1][:8]
        assert runner.is_alive() and not runner.dead.is_set()
    finally:
        runner.stop()


def test_an_engine_that_keeps_failing_is_dead_and_refuses_new_work(models, prompt_ids):
    eng = colocated_engine(models["llama"], None, 0, 4)
    died = threading.Event()
    runner = EngineRunner(eng, on_dead=died.set)
    eng.model = type(eng.model)(**{**eng.model.__dict__})
    object.__setattr__(eng.model, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("broken")))
    runner.start()
    for i in range(MAX_FAILED_STEPS):
        assert _run(runner, prompt_ids[i], SamplingParams(max_tokens=4))[-1].error
    assert died.wait(10) and runner.dead.is_set()
    after = _run(runner, prompt_ids[5], SamplingParams(max_tokens=4))  # answered at once, with a reason
    assert after[-1].error == "engine stopped"


def test_a_request_the_failing_step_finished_still_gets_its_output(models, prompt_ids, reference):
    """A one-token request is prefilled (and finished) in the step whose decode pass then raises: it gets its
    token, not a wait for ever (before, only the still-running requests were answered, with the error)."""
    eng = colocated_engine(models["llama"], None, 0, 4)
    runner = EngineRunner(eng)
    forward, short = eng.model.forward, list(prompt_ids[1])
    armed = {"prefilled": False, "raised": False}

    def flaky(cache, slots, tokens, *a, **k):  # fault injection: the pass after the short prompt's prefill raises
        if armed["prefilled"] and not armed["raised"]:
            armed["raised"] = True
            raise RuntimeError("injected")
        out = forward(cache, slots, tokens, *a, **k)
        armed["prefilled"] = armed["prefilled"] or any(list(t) == short for t in tokens)
        return out

    eng.model = type(eng.model)(**{**eng.model.__dict__})
    object.__setattr__(eng.model, "forward", flaky)
    long_done, long_outs = threading.Event(), []

    def on_long(out):
        long_outs.append(out)
        if out.finished:
            long_done.set()
    runner.start()
    try:
        runner.submit(prompt_ids[0], SamplingParams(max_tokens=200, ignore_eos=True), "long", on_long)
        deadline = time.monotonic() + 30
        while len(long_outs) < 3 and time.monotonic() < deadline:  # the long request is decoding
            time.sleep(0.01)
        done, outs = threading.Event(), []

        def on_short(out):
            outs.append(out)
            if out.finished:
                done.set()
        runner.submit(short, SamplingParams(max_tokens=1), "short", on_short)
        assert done.wait(20), "the request finished by the failing step was never answered"
        assert armed["raised"]
        assert outs[-1].error is None and [t for o in outs for t in o.new_token_ids] == reference("llama")[1][:1]
        assert long_done.wait(20) and long_outs[-1].error  # the decoding request failed with the step
    finally:
        runner.stop()


@pytest.mark.parametrize("gamma", [0, 3])
def test_a_sequence_runs_to_the_models_context_as_the_model_alone_does(models, prompt_ids, gamma):
    """One slot, the default KV budget: a request ends at the model's context, not max_gamma + 1 tokens short of
    it (before, 9 tokens were held back and prompts that long were refused)."""
    m = models["llama"]
    eng = colocated_engine(m, models["draft"] if gamma else None, gamma, 1)
    prompt = (list(prompt_ids[0]) * 64)[:m.max_context - 6]
    assert eng.validate_prompt(prompt) == prompt
    out = eng.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert len(prompt) + len(out.output_ids) == m.max_context and out.finish_reason == "length"
    assert out.output_ids == hf_greedy(m, prompt, 6)  # the target alone's tokens, up to its last position
    eng.validate_prompt((prompt * 2)[:m.max_context - 1])  # one token left to generate: accepted
