"""The ragged cache must give the same logits as a plain full forward, for every family."""

import pytest
import torch

FAMILIES = ["llama", "qwen2", "gpt2"]
TOL = 1e-4


def full_logits(m, ids):
    with torch.no_grad():
        return m.model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_prefill_decode_rollback_and_leave(models, family):
    m = models[family]
    seqs = [[5, 17, 42, 99, 3, 8, 250], [11, 12], [7, 7, 7, 300, 301, 302, 303, 304, 2, 9, 10]]
    cache = m.new_cache()
    slots = [cache.allocate() for _ in seqs]
    # Prefill of different lengths in one pass.
    out = m.forward(cache, slots, seqs, [[len(s) - 1] for s in seqs])
    for s, lg in zip(seqs, out, strict=False):
        assert torch.allclose(lg[0], full_logits(m, s), atol=TOL)
    # Ragged append: 1, 3 and 2 new tokens.
    new = [[40], [41, 42, 43], [44, 45]]
    out = m.forward(cache, slots, new, [list(range(len(n))) for n in new])
    for s, n, lg in zip(seqs, new, out, strict=False):
        for j in range(len(n)):
            assert torch.allclose(lg[j], full_logits(m, s + n[: j + 1]), atol=TOL)
        s.extend(n)
    # Roll the middle sequence back by two (rejected drafts), then continue it alone.
    cache.truncate(slots[1], len(seqs[1]) - 2)
    del seqs[1][-2:]
    out = m.forward(cache, [slots[1]], [[77]], [[0]])
    seqs[1].append(77)
    assert torch.allclose(out[0][0], full_logits(m, seqs[1]), atol=TOL)
    # The first sequence leaves: the last slot moves into its place, nothing is recomputed.
    moved = cache.free(slots[0])
    assert moved == 2 and cache.lengths == [len(seqs[2]), len(seqs[1])]
    out = m.forward(cache, [0, 1], [[60], [61]], [[0], [0]])
    assert torch.allclose(out[0][0], full_logits(m, seqs[2] + [60]), atol=TOL)
    assert torch.allclose(out[1][0], full_logits(m, seqs[1] + [61]), atol=TOL)


def test_scattered_slots_and_growth(models):
    """Non-contiguous slot subsets and buffers that grow past their first capacity."""
    m = models["llama"]
    cache = m.new_cache()
    seqs = [[i + 3] * (5 + i) for i in range(6)]  # more slots than the initial 4
    slots = [cache.allocate() for _ in seqs]
    m.forward(cache, slots, seqs, [[0]] * len(seqs))
    long = list(range(3, 303))  # past the initial 256-token capacity
    out = m.forward(cache, [4, 1], [long, [9]], [[len(long) - 1], [0]])
    assert torch.allclose(out[0][0], full_logits(m, seqs[4] + long), atol=TOL)
    assert torch.allclose(out[1][0], full_logits(m, seqs[1] + [9]), atol=TOL)
    assert cache.tokens_used() == sum(map(len, seqs)) + len(long) + 1


@pytest.mark.parametrize("slots_order", [[0, 1], [1, 0]])  # the view path and the gather path
def test_a_budgeted_cache_never_grows_for_padding(models, slots_order):
    """A short row beside a long feed: its padding would write up to its start + Q; in a budgeted cache it
    writes one position past its valid length, and every real row's logits stay exact."""
    m = models["llama"]
    cache = m.new_cache()
    cache.max_cells = 2 * 256
    seqs = [list(range(3, 203)), [5, 6]]
    slots = [cache.allocate() for _ in seqs]
    m.forward(cache, slots, seqs, [[len(s) - 1] for s in seqs])
    feeds = {0: [7], 1: list(range(10, 90))}  # slot 0 at 200 tokens + 1, slot 1 at 2 tokens + 80
    out = m.forward(cache, slots_order, [feeds[s] for s in slots_order], [[len(feeds[s]) - 1] for s in slots_order])
    assert cache.get_seq_length() == 202  # 201 real + 1 padding position (unbudgeted: 200 + 80)
    assert cache._len_cap == 256
    for s, lg in zip(slots_order, out, strict=True):
        assert torch.allclose(lg[0], full_logits(m, seqs[s] + feeds[s]), atol=TOL)
    out = m.forward(cache, [0, 1], [[8], [90]], [[0], [0]])  # the padding garbage is never attended
    assert torch.allclose(out[0][0], full_logits(m, seqs[0] + feeds[0] + [8]), atol=TOL)
    assert torch.allclose(out[1][0], full_logits(m, seqs[1] + feeds[1] + [90]), atol=TOL)


def test_skinny_linear_matches_f_linear(models):
    """The few-rows CPU path computes the same product (to float rounding) and is installed."""
    import torch.nn.functional as F

    from starjar.cpu import skinny_linear
    lin = torch.nn.Linear(48, 300, bias=True)
    assert skinny_linear.install(torch.nn.Sequential(lin)) == 1
    for r in (1, 2, 5, 33):
        x = torch.randn(3, r, 48)
        assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)
    head = models["llama"].model.get_output_embeddings()
    assert "forward" in head.__dict__  # load_model installed it on the CPU fp32 model


def test_the_slice_write_equals_the_scatter_write_with_padding_and_a_budget(models, monkeypatch):
    # Rows at the same length write one slice instead of scattering; padded rows in a budgeted cache clamp
    # their padding writes. Both ways must give the same logits and the same KV at every valid position.
    from starjar.model.kv_cache import RaggedKVCache
    m = models["llama"]

    def run(span: bool, budget):
        cache = m.new_cache()
        cache.max_cells = budget
        slots = [cache.allocate() for _ in range(3)]
        out = m.forward(cache, slots, [[5, 6, 7, 8]] * 3, [[3]] * 3)
        out += m.forward(cache, slots, [[9], [10, 11, 12], [13, 14]], [[0], [2], [1]])
        out += m.forward(cache, slots, [[20], [21], [22]], [[0]] * 3)
        return out, cache

    begin = RaggedKVCache.begin
    for budget in (None, 3 * 16):
        with_span, a = run(True, budget)

        def scatter_only(self, *args, **kwargs):
            result = begin(self, *args, **kwargs)
            self._write_span = None
            return result
        monkeypatch.setattr(RaggedKVCache, "begin", scatter_only)
        scattered, b = run(False, budget)
        monkeypatch.setattr(RaggedKVCache, "begin", begin)
        assert all(torch.equal(x, y) for x, y in zip(with_span, scattered, strict=True))
        for ka, kb in zip(a._keys + a._values, b._keys + b._values, strict=True):
            for s, n in enumerate(a.lengths):
                assert torch.equal(ka[s, :, :n], kb[s, :, :n])


def test_a_long_prompt_grows_the_cache_once(models):
    """A 770-token prompt: the cache grows to the next power of two (1024) and its decode steps fit, where
    growing to exactly 771 made the first decode step grow it again, to 1542 (every buffer zeroed and copied
    twice). The logits stay exact across the growth."""
    m = models["llama"]
    cache = m.new_cache()
    grown = []
    grow = cache._grow
    cache._grow = lambda slots=None, length=None: (grown.append(length), grow(slots, length))
    prompt = [3 + i % 200 for i in range(770)]
    slot = cache.allocate()
    m.forward(cache, [slot], [prompt], [[769]])
    out = m.forward(cache, [slot], [[7, 8, 9]], [[2]])
    assert [g for g in grown if g] == [1024] and cache._len_cap == 1024
    assert torch.allclose(out[0][0], full_logits(m, prompt + [7, 8, 9]), atol=TOL)


def test_reserve_makes_room_before_a_prompt_goes_in_over_several_passes(models):
    m = models["llama"]
    lazy = m.new_cache()
    lazy.reserve(900)  # no buffers yet: they are made at that size
    assert lazy._len_cap == 1024
    cache = m.new_cache()
    slot = cache.allocate()
    m.forward(cache, [slot], [list(range(3, 103))], [[99]])
    cache.reserve(600)
    assert cache._len_cap == 1024 and cache._keys[0].shape[2] == 1024
    budgeted = m.new_cache()
    budgeted.max_cells = 4 * 512  # 4 slots x 1024 would pass the budget: left to grow pass by pass
    budgeted.reserve(900)
    assert budgeted._len_cap == 256


def test_a_one_token_step_begins_as_the_general_pass_does():
    """begin() for one token on one slot (its short path) gives the general path's positions, mask and write
    state: the general path, which a budget forces, on a twin cache holding the same lengths, growth included."""
    from starjar.model.kv_cache import RaggedKVCache

    short, general = RaggedKVCache("cpu", torch.float32, initial_capacity=8), \
        RaggedKVCache("cpu", torch.float32, initial_capacity=8, max_cells=1 << 20)
    for cache in (short, general):
        for _ in range(3):
            cache.allocate()
        cache.begin([0, 1, 2], [5, 7, 2])
    for slot in (1, 0, 1, 1, 2):  # slot 1 passes the 8 positions the caches started with
        got, want = short.begin([slot], [1]), general.begin([slot], [1])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        for name in ("_kv_len", "_rows", "_write_span", "_tree_pass", "_len_cap", "lengths"):
            assert getattr(short, name) == getattr(general, name), name
        assert torch.equal(short._write_pos, general._write_pos)
