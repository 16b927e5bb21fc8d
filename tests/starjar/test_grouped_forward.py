"""The grouped forward both engines use: length groups, a token cap per pass, rows in slot order."""

from __future__ import annotations

from starjar.model.grouped_forward import grouped_forward, length_groups


class _Recorder:
    """Stands in for a LoadedModel: records each pass's slots and feeds, answers one row of logits each."""

    def __init__(self):
        self.passes = []

    def forward(self, cache, slots, tokens, logit_rows):
        self.passes.append((list(slots), [list(t) for t in tokens], logit_rows))
        return [[len(t)] for t in tokens]


def test_length_groups_keep_padding_bounded_and_short_rows_together():
    assert length_groups([200, 2, 190, 3], lambda n: n) == [[200, 190], [3, 2]]
    assert length_groups([8, 1, 2], lambda n: n, short=8) == [[8, 2, 1]]


def test_each_pass_runs_in_slot_order_within_the_token_cap():
    rows = [(3, [1] * 4), (0, [1] * 100), (1, [1] * 4), (2, [1] * 90), (4, [1])]
    model = _Recorder()
    passes = list(grouped_forward(model, None, rows, feed=lambda r: r[1], slot=lambda r: r[0], short=4,
                                  max_pass_tokens=150))
    # 100 and 90 tokens would share a pass by padding, but not within 150 tokens; the short rows share one.
    assert [slots for slots, _, _ in model.passes] == [[0], [2], [1, 3, 4]]
    assert [[r[0] for r in p.rows] for p in passes] == [[0], [2], [1, 3, 4]]
    assert all(rows == [[len(f) - 1] for f in feeds] for _, feeds, rows in model.passes)


def test_the_token_cap_counts_padding():
    rows = [(0, [1] * 100), (1, [1] * 90)]
    model = _Recorder()
    list(grouped_forward(model, None, rows, feed=lambda r: r[1], slot=lambda r: r[0], max_pass_tokens=190))
    # 190 real tokens fit, but padded the pass is 2 x 100: its mask and scores would be sized for 200.
    assert [slots for slots, _, _ in model.passes] == [[0], [1]]


def test_scattered_slots_are_split_so_a_pass_never_copies_more_kv_than_the_cap():
    # One-token steps of rows whose contexts are 1000 keys: slots 0-3 are consecutive (the cache reads them
    # as a view: no copy, no limit); slots 10, 12, 14, 16 are not (their K and V are gathered per layer).
    rows = [(s, [1]) for s in (0, 1, 2, 3, 10, 12, 14, 16)]
    model = _Recorder()
    list(grouped_forward(model, None, rows, feed=lambda r: r[1], slot=lambda r: r[0], short=8,
                         context=lambda r: 1000, max_gather_cells=2500))
    assert [slots for slots, _, _ in model.passes] == [[0, 1, 2, 3], [10, 12], [14, 16]]
    # Without the cap (or without contexts) every short row shares one pass, as before.
    model = _Recorder()
    list(grouped_forward(model, None, rows, feed=lambda r: r[1], slot=lambda r: r[0], short=8))
    assert [slots for slots, _, _ in model.passes] == [[0, 1, 2, 3, 10, 12, 14, 16]]
