"""The int8 draft: per-row activation scales keep a row's output close to float whatever its batch, and speculative
decoding with an int8 copy of the target stays lossless."""

import copy

import pytest
import torch

from controller.colocated import colocated_engine
from controller.tuning import scoring
from draft_server.engine import DraftEngine
from starjar.cpu.quantized import RowInt8Linear, quantize_int8
from starjar.model.loading import LoadedModel
from starjar.spec.proposer import DraftRequest
from starjar.spec.sampling import SamplingParams

PATHS = pytest.mark.parametrize("path", ["int_mm", "fused"])


def int8_copy(m: LoadedModel, path: str | None = None) -> LoadedModel:
    return LoadedModel(m.path, quantize_int8(copy.deepcopy(m.model), path), m.tokenizer, m.device, m.dtype,
                       m.vocab_size, m.max_context, m.eos_token_ids, m.fingerprint)


@PATHS
def test_every_linear_is_int8_and_close_to_float(models, path, monkeypatch):
    monkeypatch.setenv("STARJAR_INT8_KERNEL", path)  # the path a machine of that kind would choose
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    q = quantize_int8(torch.nn.Sequential(lin))[0]
    assert isinstance(q, RowInt8Linear) and q.path == path
    assert (q.w_t is not None) == (path == "int_mm")  # the _int_mm layout is kept only where it is used
    x = torch.randn(5, 7, 64)
    x[0, 0] *= 300  # an outlier token, as the first tokens of a prompt are
    ref = lin(x)
    err = (q(x) - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert err.max() < 0.05  # per row, even next to the outlier (one scale per tensor would lose them)
    assert (q(x[2:3, 4:5]) - ref[2:3, 4:5]).abs().max() / ref[2:3, 4:5].abs().max() < 0.05  # the one-row path
    m = int8_copy(models["llama"])
    assert not any(isinstance(x, torch.nn.Linear) for x in m.model.modules())


@PATHS
def test_a_rows_output_barely_depends_on_its_batch(path):
    torch.manual_seed(1)
    q = quantize_int8(torch.nn.Sequential(torch.nn.Linear(32, 16)), path)[0]
    x = torch.randn(6, 32)
    alone = q(x[1:3])
    x[4] *= 1000  # another sequence's outlier in the same pass
    moved = (q(x)[1:3] - alone).abs().max() / alone.abs().max()
    assert moved < 0.03  # one activation range per tensor would move these rows by about half their range


@PATHS
def test_batched_drafts_equal_drafts_alone(models, path):
    d = int8_copy(models["draft"], path)
    prompts = [[5, 6, 7, 8], [100, 101, 102], [42] * 9, [300, 7]]
    together = DraftEngine(d).propose([DraftRequest(i, 0, p, 4) for i, p in enumerate(prompts)])
    alone = [DraftEngine(d).propose([DraftRequest(0, 0, p, 4)])[0] for p in prompts]
    assert together == alone


@PATHS
def test_greedy_output_with_an_int8_draft_is_the_targets(models, prompt_ids, reference, path):
    draft = int8_copy(models["llama"], path)  # the default pair's recipe on the tiny target
    eng = colocated_engine(models["llama"], draft, 3, 8)
    outs = [r.output_ids for r in eng.generate(prompt_ids[:8], SamplingParams(max_tokens=64))]
    assert outs == reference("llama")[:8]
    assert eng.stats.acceptance_rate > 0.5  # a copy of the target predicts it


def test_the_pair_check_measures_once_per_machine_and_keeps_the_choice(tmp_path, model_dirs, monkeypatch):
    import json
    import shutil

    from controller.tuning import pair_check
    draft_dir = tmp_path / "draft"
    shutil.copytree(model_dirs["llama"], draft_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    (draft_dir / "starjar.json").write_text(json.dumps({"kind": "dynamic-int8", "weights_from": model_dirs["llama"]}))
    # A tiny draft costs about what its tiny target does, so whether it could pay at all (the ceiling) depends
    # on the machine's noise: every candidate is let through to scoring here, as the default pair's are.
    monkeypatch.setattr(pair_check, "PAYS", 0.0)
    # Tiny models' passes are short enough that noise alone can make one look like a cliff kernel.
    monkeypatch.setattr(pair_check, "CLIFF", float("inf"))
    first = pair_check.measured_acceptance(model_dirs["llama"], str(draft_dir), max_new=8)
    names = {(c["int8_kernel"], c["head_vocab"]) for c in first["candidates"] if not c.get("skip_layers")}
    assert names == {(k, h) for k in ("int_mm", "fused") for h in (None, pair_check.HEAD_VOCAB)}
    # Finer activations: the best kernel/head candidate again with 8-bit activations, smoothing and both.
    def finer(c):
        return c.get("act_bits"), c.get("smooth_alpha")
    base = [c for c in first["candidates"] if finer(c) == (None, None) and c["agreement"] is not None]
    best_base = max(base, key=lambda c: c["predicted_speedup"])
    tried = [c for c in first["candidates"] if finer(c) != (None, None) and not c.get("skip_layers")]
    assert [finer(c) for c in tried] == [(8, None), (None, 0.5), (8, 0.5)]
    assert all((c["int8_kernel"], c["head_vocab"], c["agreement"] is not None) ==
               (best_base["int8_kernel"], best_base["head_vocab"], True) for c in tried)
    best_so_far = max(base + tried, key=lambda c: c["predicted_speedup"])
    # Self-speculation: every layer left out alone is scored, and the least harmful one makes a candidate. The
    # scan runs only where the best variant so far speculates at some gamma; a tiny int8 draft costs about what
    # its tiny target does, so whether it does here depends on this machine's timings.
    skipping = [c for c in first["candidates"] if c.get("skip_layers")]
    assert bool(first["skip_scan"]) == bool(skipping) == (best_so_far["best_gamma"] > 0)
    if skipping:
        assert sorted(first["skip_scan"]) == ["0", "1"]  # JSON keys: by layer
        least_harmful = max(first["skip_scan"], key=first["skip_scan"].get)
        assert [c["skip_layers"] for c in skipping] == [[int(least_harmful)]]  # 2 layers: only one may go
        assert skipping[0]["agreement"] is not None and skipping[0]["cost_b1"] > 0
        assert finer(skipping[0]) == finer(best_so_far)  # layers are left out of the best variant so far
    assert first["machine"]["cpu_capability"] and first["gamma"] >= 0 and first["verdict"]
    scored = [c for c in first["candidates"] if c["agreement"] is not None]
    assert scored and all(0 <= c["agreement"] <= 1 and c["cost_b1"] > 0 for c in scored)
    if first["gamma"] > 0:  # the confirmation runs: outputs identical; speculation beat the target alone where
        assert first["identical"] == first["prompts"]  # the build was sure (not on a busy machine: undecided)
        assert first["confidence"] == "undecided" or first["speedup_batch1"] >= 1.0
    recipe = json.loads((draft_dir / "starjar.json").read_text())
    assert recipe["measured"] == first and recipe.get("int8_kernel") == first["chosen"]["int8_kernel"]
    assert (recipe.get("act_bits"), recipe.get("smooth_alpha")) == finer(first["chosen"])  # later loads use it
    monkeypatch.setattr(pair_check, "measure_pair", None)  # a second measurement would fail
    assert pair_check.measured_acceptance(model_dirs["llama"], str(draft_dir)) == first
    other = dict(first["machine"], cpu_model="another CPU")  # a different machine measures again
    recipe["measured"]["machine"] = other
    (draft_dir / "starjar.json").write_text(json.dumps(recipe))
    with pytest.raises(TypeError):
        pair_check.measured_acceptance(model_dirs["llama"], str(draft_dir))
    # Back and forth between two machines (or thread counts): each one's measurement is taken back, not redone.
    theirs = {**first, "machine": other, "gamma": 0, "chosen": {"int8_kernel": "int_mm", "head_vocab": None}}
    recipe = {**recipe, "measured": theirs, "int8_kernel": "int_mm", "measured_elsewhere": [first]}
    (draft_dir / "starjar.json").write_text(json.dumps(recipe))
    assert pair_check.measured_acceptance(model_dirs["llama"], str(draft_dir)) == first
    saved = json.loads((draft_dir / "starjar.json").read_text())
    assert saved["measured"] == first and saved.get("int8_kernel") == first["chosen"]["int8_kernel"]
    assert [m["machine"] for m in saved["measured_elsewhere"]] == [other]  # theirs kept for their turn


def test_layers_are_scanned_only_for_a_draft_that_speculates(monkeypatch):
    """Self-speculation scans the best draft with each layer left out (one scoring per layer). Where even the best
    loses to no draft at every gamma (a cliff kernel: gamma 0) the scan is skipped: it cost minutes there and could
    only say gamma 0. A draft just short of PAYS is scanned: a cheaper copy may carry it over."""
    from controller.tuning import layer_skip, pair_check
    asked = []
    monkeypatch.setattr(layer_skip, "candidates",
                        lambda target, draft_dir, base, *rest: asked.append(base["name"]) or ([], {"0": 0.5}))
    rows = [{"name": "slow", "agreement": 0.88, "best_gamma": 0, "predicted_speedup": 1.0},
            {"name": "cliff", "agreement": None, "best_gamma": 0, "predicted_speedup": 0.0}]
    assert pair_check._skip_candidates(None, "draft", rows, [], [], []) == {} and not asked
    rows.append({"name": "almost", "agreement": 0.85, "best_gamma": 2, "predicted_speedup": pair_check.PAYS - 0.02})
    assert pair_check._skip_candidates(None, "draft", rows, [], [], []) == {"0": 0.5} and asked == ["almost"]


def test_where_no_draft_pays_the_one_kept_is_the_least_bad_at_a_forced_gamma():
    """All scored, all at gamma 0 (the int_mm cliff, AVX2 held): the draft kept for a gamma forced by hand is the
    one that loses least when speculating, not the one whose ceiling (every draft accepted) is highest."""
    from controller.tuning import pair_check
    verify = [1.0, 0.91, 1.10, 0.89, 1.13, 1.42, 1.66]  # as measured there
    saturated = {"name": "8-bit", "agreement": 0.375, "cost_b1": 0.19, "cost_catchup": 3.25, "ceiling": 1.2,
                 "predicted_speedup": 1.0}
    smoothed = {"name": "smoothed", "agreement": 0.885, "cost_b1": 0.21, "cost_catchup": 3.52, "ceiling": 1.1,
                "predicted_speedup": 1.0}
    ruled_out = {"name": "dearer", "agreement": None, "cost_b1": 0.2, "cost_catchup": 9.0, "ceiling": 1.5,
                 "predicted_speedup": 0.0}
    assert pair_check._best([saturated, ruled_out, smoothed], verify)["name"] == "smoothed"
    assert pair_check._best([dict(ruled_out, ceiling=0.6), ruled_out], verify) is ruled_out  # none scored


def test_agreement_is_measured_in_the_steps_drafting_takes(model_dirs):
    from controller.colocated import colocated_engine
    from controller.tuning.scoring import agreement as _agreement
    from starjar.model.loading import load_model
    from starjar.spec.sampling import SamplingParams

    target = load_model(model_dirs["llama"], what="target")
    prompts = [[5, 9, 13, 2, 7], [11, 3, 8]]
    engine = colocated_engine(target, None, 0, 1)
    outputs = [r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=6))]
    calls = []
    forward = target.forward

    def recording(cache, slots, ids, logit_positions):
        calls.append(len(ids[0]))
        return forward(cache, slots, ids, logit_positions)

    target.forward = recording
    # The target as its own draft agrees everywhere, in steps as in one pass.
    assert _agreement(target, prompts, outputs) == 1.0
    # The prompt in one pass, then one token per step (each output's last token is never fed).
    pairs = list(zip(prompts, outputs, strict=True))
    assert calls == [n for p, out in pairs for n in [len(p)] + [1] * (len(out) - 1)]
    assert calls.count(1) > 2
    calls.clear()
    assert _agreement(target, prompts, outputs, stepwise=False) == 1.0
    assert calls == [len(p) + len(out) - 1 for p, out in pairs]
    draft = load_model(model_dirs["draft"], what="draft")  # one layer fewer: it must miss somewhere
    assert 0.0 <= _agreement(draft, prompts, outputs) < 1.0


def test_a_measurement_names_its_isa_limits_and_how_agreement_was_taken(monkeypatch):
    from controller.tuning.pair_check import AGREEMENT, machine_fields
    from starjar.cpu import kernels, machine
    for name in kernels.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    plain = machine_fields(machine.machine_info())
    assert "isa_limits" not in plain and plain["agreement"] == AGREEMENT == "stepwise"
    monkeypatch.setenv("STARJAR_INT_MM_ONEDNN", "1")  # oneDNN on, as without it: not a limit
    assert machine_fields(machine.machine_info()) == plain
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "avx2")
    monkeypatch.setenv("STARJAR_INT_MM_ONEDNN", "0")
    limited = machine_fields(machine.machine_info())
    assert limited["isa_limits"] == {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "STARJAR_INT_MM_ONEDNN": "0"}
    assert {k: v for k, v in limited.items() if k != "isa_limits"} == plain


def test_a_measurement_taken_with_other_native_kernels_is_stale(monkeypatch):
    from controller.tuning.pair_check import machine_fields
    from starjar.cpu import kernels, machine

    here = machine_fields(machine.machine_info())
    assert here["native_kernels"] == kernels.native_digest()
    monkeypatch.setattr(kernels, "native_digest", lambda: "another-build")  # an upgrade's sources
    assert machine_fields(machine.machine_info()) != here


def test_the_speedup_model_turns_speculation_off_when_drafts_cost_too_much():
    from controller.tuning.scoring import best_gamma

    flat = [1.0, 1.05, 1.1, 1.15, 1.2]
    assert best_gamma(0.8, 0.2, 0.25, flat)[0] >= 2  # cheap drafts, good acceptance: speculate
    assert best_gamma(0.8, 1.5, 1.6, flat) == (0, 1.0)  # a draft step dearer than a target step: never


def _int8_draft_dir(tmp_path, model_dirs):
    import json
    import shutil

    draft_dir = tmp_path / "draft"
    shutil.copytree(model_dirs["llama"], draft_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    (draft_dir / "starjar.json").write_text(json.dumps({"kind": "dynamic-int8", "weights_from": model_dirs["llama"]}))
    return str(draft_dir)


def _costs_by_kernel(monkeypatch, pair_check, int_mm: tuple, fused: tuple) -> None:
    """_cost_ratios as measured per candidate: the int_mm ones come first (full head, then the 16k head)."""
    calls = []

    def costs(target, draft):
        calls.append(1)
        return int_mm if len(calls) <= 2 else fused
    monkeypatch.setattr(scoring, "cost_ratios", costs)


def test_drafts_that_cannot_pay_even_fully_accepted_are_not_scored(tmp_path, model_dirs, monkeypatch):
    from controller.tuning import pair_check, scoring
    draft_dir = _int8_draft_dir(tmp_path, model_dirs)
    # Every kernel path on a cliff (catch-ups of 2.5-3.5 target steps, as the EPYC's generic int_mm) and
    # verification growing with gamma: even with every draft accepted nothing pays.
    _costs_by_kernel(monkeypatch, pair_check, int_mm=(0.6, 3.5, 3.4), fused=(0.6, 2.5, 2.4))
    verify = [1.0 + 0.3 * g for g in range(scoring.MAX_GAMMA + 1)]
    monkeypatch.setattr(scoring, "verify_costs", lambda target: verify)
    monkeypatch.setattr(scoring, "agreement", lambda *a, **k: pytest.fail("scored a draft that cannot pay"))
    result = pair_check.measured_acceptance(model_dirs["llama"], draft_dir, max_new=4)
    assert len(result["candidates"]) == 4
    assert all("with every draft accepted" in c["note"] for c in result["candidates"])
    ceiling = max(scoring.round_speedup(1.0, g, 0.6, 2.5, verify) for g in range(1, len(verify)))
    assert 0.5 < ceiling < pair_check.PAYS
    assert [c["ceiling"] for c in result["candidates"]][2:] == [round(ceiling, 3)] * 2
    assert result["gamma"] == 0 and f"at most {ceiling:.2f}x" in result["verdict"]
    # Kept for a gamma forced by hand: the least bad draft, not the first listed (the dearer int_mm).
    assert result["chosen"]["int8_kernel"] == "fused"


def test_a_draft_that_could_pay_is_scored_beside_one_that_cannot(tmp_path, model_dirs, monkeypatch):
    from controller.tuning import pair_check
    draft_dir = _int8_draft_dir(tmp_path, model_dirs)
    # int_mm: a step as dear as the target's and a catch-up of 0.95 steps (within 1.5x of the cheapest, so
    # not a cliff by that rule), at most 1.03x fully accepted; fused: cheap.
    _costs_by_kernel(monkeypatch, pair_check, int_mm=(1.0, 0.95, 0.9), fused=(0.3, 0.65, 0.4))
    monkeypatch.setattr(scoring, "verify_costs", lambda target: [1.0] * (scoring.MAX_GAMMA + 1))
    monkeypatch.setattr(scoring, "agreement", lambda *a, **k: 0.9)
    result = pair_check.measured_acceptance(model_dirs["llama"], draft_dir, max_new=4)
    by_kernel = {}
    for c in result["candidates"]:
        by_kernel.setdefault(c["int8_kernel"], []).append(c)
    assert all(c["agreement"] is None and "with every draft accepted" in c["note"] for c in by_kernel["int_mm"])
    assert all(c["agreement"] == 0.9 and c["predicted_speedup"] >= pair_check.PAYS for c in by_kernel["fused"])
    assert result["chosen"]["int8_kernel"] == "fused"


def test_a_forced_path_is_measured_on_its_own_and_leaves_the_choice_alone(tmp_path, model_dirs, monkeypatch):
    import json
    import shutil

    from controller.tuning import pair_check
    draft_dir = tmp_path / "draft"
    shutil.copytree(model_dirs["llama"], draft_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    recipe = {"kind": "dynamic-int8", "weights_from": model_dirs["llama"], "int8_kernel": "fused"}
    (draft_dir / "starjar.json").write_text(json.dumps(recipe))
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "int_mm")
    forced = pair_check.measured_acceptance(model_dirs["llama"], str(draft_dir), max_new=8)
    assert {c["int8_kernel"] for c in forced["candidates"]} == {"int_mm"}  # only the forced path is tried
    saved = json.loads((draft_dir / "starjar.json").read_text())
    assert saved["measured:int_mm"] == forced and "measured" not in saved
    assert saved["int8_kernel"] == "fused"  # the machine's own choice is untouched


def test_one_row_is_exactly_torchs_dynamic_int8_linear():
    # The layer calls torch's dynamic op itself (reduce_range as the module's version says): a one-row pass
    # must give exactly what torch's own module gives, not just something close to float.
    from starjar.cpu.quantized import dynamic_int8
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 24)
    q = dynamic_int8(lin)
    row = torch.randn(1, 64)
    assert torch.equal(RowInt8Linear(q)(row), q(row))
