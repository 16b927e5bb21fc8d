"""The draft engine: deltas, catch-up (switching cost), resync and release."""

from draft_server.engine import DraftEngine
from starjar.proposer import DraftRequest


def greedy_chain(model, ids, n):
    from starjar.reference import hf_greedy

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


def test_passes_split_for_the_gather_cap_draft_the_same(models, spec_prompts):
    # A round over every other sequence reads scattered slots (a K/V copy per layer); with the cap at one
    # cell every such pass is split to single rows. Drafts, trees included, must not change.
    prompts = [list(p) for p in spec_prompts[:7]]

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
