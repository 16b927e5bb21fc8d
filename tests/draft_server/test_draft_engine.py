"""The draft engine: deltas, catch-up (switching cost), resync and release."""

from draft_server.engine import DraftEngine
from starjar.spec.proposer import DraftRequest


def greedy_chain(model, ids, n):
    from benchmarks.fixtures.reference import hf_greedy

    return hf_greedy(model, ids, n)[:n]


def test_drafts_are_the_draft_models_greedy_chain(models):
    d = models["draft"]
    eng = DraftEngine(d)
    prompts = [[5, 6, 7, 8], [100, 101], [42] * 9]
    replies = eng.propose([DraftRequest(i, 0, p, g) for i, (p, g) in enumerate(zip(prompts, [3, 1, 5], strict=False))])
    for p, g, r in zip(prompts, [3, 1, 5], replies, strict=False):
        assert r == greedy_chain(d, p, g)


def test_catch_up_keeps_accepted_drafts_and_counts_the_switch(models):
    d = models["draft"]
    eng = DraftEngine(d)
    prompt = [5, 6, 7, 8]
    first = eng.propose([DraftRequest("a", 0, prompt, 4)])[0]
    # The target accepted two drafts and chose token 99: the engine keeps their KV.
    verified = prompt + first[:2] + [99]
    before = eng.stats.catchup_tokens
    reply = eng.propose([DraftRequest("a", len(prompt), first[:2] + [99], 2)])[0]
    assert eng.stats.catchup_tokens - before == 1  # only the new token is prefilled
    assert reply == greedy_chain(d, verified, 2)
    # Ten speculation-free steps later the sequence resumes: all ten are caught up at once.
    gap = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    before = eng.stats.catchup_tokens
    reply = eng.propose([DraftRequest("a", len(verified), gap, 3)])[0]
    assert eng.stats.catchup_tokens - before == len(gap)
    assert reply == greedy_chain(d, verified + gap, 3)


def test_unknown_prefix_asks_for_resync(models):
    eng = DraftEngine(models["draft"])
    assert eng.propose([DraftRequest("x", 5, [1, 2], 3)]) == [None]  # never seen: needs position 0
    eng.propose([DraftRequest("y", 0, [1, 2, 3], 1)])
    assert eng.propose([DraftRequest("y", 9, [4], 1)]) == [None]  # a gap: tokens 3..8 were lost
    assert eng.propose([DraftRequest("z", 0, [1, models["draft"].vocab_size], 1)]) == [None]
    assert eng.stats.resyncs == 3


def test_release_frees_kv_and_keeps_others_intact(models):
    d = models["draft"]
    eng = DraftEngine(d)
    prompts = {i: [10 + i, 20 + i, 30 + i] for i in range(5)}
    eng.propose([DraftRequest(i, 0, p, 2) for i, p in prompts.items()])
    eng.release([0, 2, "never-seen"])
    assert eng.num_sequences == 3 and eng.cache.num_slots == 3
    replies = eng.propose([DraftRequest(i, 3, [7], 2) for i in (1, 3, 4)])
    for i, r in zip((1, 3, 4), replies, strict=False):
        assert r == greedy_chain(d, prompts[i] + [7], 2)


def test_passes_split_for_the_gather_cap_draft_the_same(models, prompt_ids):
    # A round over every other sequence reads scattered slots (a K/V copy per layer); with the cap at one
    # cell every such pass is split to single rows. Drafts, trees included, must not change.
    prompts = [list(p) for p in prompt_ids[:7]]

    def rounds(engine):
        first = engine.propose([DraftRequest(i, 0, p, 3) for i, p in enumerate(prompts)])
        sub = [DraftRequest(i, len(prompts[i]), [7 + i] * (1 + i % 3), 3, 2 if i == 2 else 0)
               for i in range(0, len(prompts), 2)]
        second = engine.propose(sub)
        return [[(list(r.tokens), list(r.parents)) if hasattr(r, "parents") else r for r in rs]
                for rs in (first, second)]

    capped, free = DraftEngine(models["draft"], max_kv_tokens=10**6), DraftEngine(models["draft"], max_kv_tokens=10**6)
    capped.max_gather_cells, free.max_gather_cells = 1, None
    assert rounds(capped) == rounds(free)
    assert capped.stats.passes > free.stats.passes


def test_a_prompt_window_drafts_exactly_as_the_draft_would_on_the_prompts_tail(models, prompt_ids, reference):
    """A draft with prompt_window W reads a long prompt's last W tokens only (positions restart there): its drafts
    are the draft's greedy chain over that tail, its prefill is W tokens, and output through it stays the
    target's own, token for token."""
    import dataclasses

    from controller.colocated import colocated_engine
    from starjar.spec.sampling import SamplingParams

    w = 24
    windowed = dataclasses.replace(models["draft"], prompt_window=w)
    eng = DraftEngine(windowed)
    prompt = prompt_ids[3]
    assert len(prompt) > 3 * w
    first = eng.propose([DraftRequest("a", 0, prompt, 4)])[0]
    assert first == greedy_chain(models["draft"], prompt[-w:], 4)
    assert eng.stats.catchup_tokens == w
    # The target accepted one draft and chose 99; the window keeps its start, the draft its KV.
    second = eng.propose([DraftRequest("a", len(prompt), first[:1] + [99], 3)])[0]
    assert second == greedy_chain(models["draft"], prompt[-w:] + first[:1] + [99], 3)
    assert eng.stats.catchup_tokens == w + 1  # 99 only: the accepted draft's KV was kept
    # A resend from 0 of the same tokens (after a failed step) costs nothing new; a changed prefix starts over.
    eng.propose([DraftRequest("a", 0, prompt + first[:1] + [99], 1)])
    assert eng.stats.catchup_tokens == w + 2  # the last token again (logits need one fed)
    changed = [7] + prompt[1:] + first[:1] + [99]
    assert eng.propose([DraftRequest("a", 0, changed, 2)])[0] == greedy_chain(models["draft"], changed[-w:], 2)
    assert eng.stats.catchup_tokens == w + 2 + w  # the window again, from scratch
    engine = colocated_engine(models["llama"], windowed, 3, 4)
    reqs = engine.generate(prompt_ids[:12], SamplingParams(max_tokens=32))
    assert [r.output_ids for r in reqs] == reference("llama", 32)[:12]
    assert engine.stats.accepted_tokens > 0


def _staged(eng: DraftEngine, seq_id, prompt, gamma) -> list[int]:
    """One round for a new sequence, then its chain drafted ahead to the end (lookahead chain)."""
    replies, jobs = eng.start([DraftRequest(seq_id, 0, prompt, gamma)])
    while not all(j.done for _, j in jobs):
        eng.advance([j for _, j in jobs])
    assert eng.stage(jobs[0][1])
    while eng.ahead.jobs():
        eng.advance_lookahead(eng.ahead.jobs())
    return jobs[0][1].drafts


def test_work_ahead_gives_way_when_a_real_round_needs_its_kv_budget(models):
    # Two rows of 45 (a 40-token prompt, 4 drafts, one more) fit the budget; a staged row may grow to 49.
    prompt, gamma = list(range(3, 43)), 4
    eng = DraftEngine(models["draft"], max_kv_tokens=2 * (len(prompt) + gamma + 1) + 4)
    drafted = _staged(eng, "a", prompt, gamma)
    stage = eng.ahead.stages["a"]
    assert stage.extent == len(prompt) + 2 * gamma + 1 and eng.cache.lengths[stage.seq.slot] > stage.base_cached
    wasted = eng.stats.lookahead_wasted
    # A second sequence fits the budget only with the stage's KV given back: it is admitted, the stage is not.
    assert eng.propose([DraftRequest("b", 0, prompt, gamma)]) == [greedy_chain(models["draft"], prompt, gamma)]
    assert not eng.ahead.stages and eng.stats.lookahead_wasted > wasted
    assert eng.num_sequences * max(eng.cache.lengths) <= eng.max_kv_tokens
    # The first sequence's next round (its first draft rejected) is answered as without lookahead.
    fix = [drafted[0] % 50 + 1]
    assert eng.propose([DraftRequest("a", len(prompt), fix, gamma)]) == \
        [greedy_chain(models["draft"], prompt + fix, gamma)]

