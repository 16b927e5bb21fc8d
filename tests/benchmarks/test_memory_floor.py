"""The memory floor `bench core` prints: the weights a step reads, counted once, and a decode rate against it."""

from benchmarks import memory_floor as mf


def test_tied_weights_count_once_and_the_floor_is_bandwidth_over_bytes(models, prompt_ids, monkeypatch):
    target = models["llama"]
    model = target.model
    distinct = {p.data_ptr(): p.numel() * p.element_size() for p in list(model.parameters()) + list(model.buffers())}
    assert mf.weight_bytes(model) == sum(distinct.values())  # by storage: a tied head is not read twice
    monkeypatch.setattr(mf, "PROBE_BYTES", 16 << 20)
    monkeypatch.setattr(mf, "DECODE_TOKENS", 8)
    monkeypatch.setattr(mf, "SUSTAIN_S", 0.05)
    got = mf.memory_floor(target, list(prompt_ids[0]))
    assert got["bytes_per_token"] == mf.weight_bytes(model) and got["read_bandwidth_gb_per_s"] > 0
    assert abs(got["floor_tokens_per_s"] - got["read_bandwidth_gb_per_s"] * 1e9 / got["bytes_per_token"]) < 0.01 * \
        got["floor_tokens_per_s"] + 0.01
    assert got["decode_batch1_tokens_per_s"] > 0
    # Each run against the probe taken just before it: the fraction is the median of those ratios.
    ratios = sorted(r["decode_tokens_per_s"] * got["bytes_per_token"] / (r["read_bandwidth_gb_per_s"] * 1e9)
                    for r in got["runs"])
    assert len(ratios) == mf.DECODE_REPEATS and abs(got["fraction_of_floor"] - ratios[len(ratios) // 2]) < 0.002
    # And against the rate sustained around it (before and after, as long as a run): likewise the median.
    sustained = sorted(r["decode_tokens_per_s"] * got["bytes_per_token"] / (r["sustained_read_gb_per_s"] * 1e9)
                       for r in got["runs"])
    assert abs(got["fraction_of_sustained"] - sustained[len(sustained) // 2]) < 0.002
    assert got["sustained_read_gb_per_s"] == sorted(r["sustained_read_gb_per_s"] for r in got["runs"])[2] > 0
