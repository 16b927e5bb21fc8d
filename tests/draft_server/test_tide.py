"""Online draft adaptation (TIDE), its parts alone: collection control, the buffer, the trainer's micro-steps."""

from __future__ import annotations

import time

import pytest
import torch

from draft_server.tide.buffer import BufferConfig, TrainingBuffer
from draft_server.tide.collect import CollectConfig, CollectionControl
from draft_server.tide.config import TrainConfig, train_config_from
from draft_server.tide.trainer import AdapterTrainer, LowRankLogits
from starjar.errors import InvalidArgument
from starjar.spec.proposer import DraftRequest

# ---- collection control (Algorithm 1) -------------------------------------------------------------


def _feed(ctl: CollectionControl, alpha: float, rounds: int) -> None:
    for _ in range(rounds):
        ctl.observe(round(alpha * 4), 4)


def test_collection_starts_off_and_turns_on_when_acceptance_drops():
    ctl = CollectionControl(CollectConfig(init_rounds=10, margin=0.05))
    _feed(ctl, 0.75, 200)
    assert not ctl.collecting and ctl.short == pytest.approx(0.75) and ctl.long == pytest.approx(0.75)
    _feed(ctl, 0.25, 3)  # a drift: the short average falls first
    assert ctl.collecting and ctl.switched_on == 1
    assert ctl.short < ctl.long - 0.05


def test_a_small_dip_within_the_margin_does_not_turn_collection_on():
    ctl = CollectionControl(CollectConfig(init_rounds=5, margin=0.2))
    _feed(ctl, 0.75, 100)
    _feed(ctl, 0.5, 3)
    assert not ctl.collecting


def test_averages_start_only_after_init_rounds_and_ignore_empty_rounds():
    ctl = CollectionControl(CollectConfig(init_rounds=4))
    ctl.observe(0, 0)  # nothing proposed: no information
    _feed(ctl, 1.0, 3)
    assert ctl.short is None
    ctl.observe(0, 4)
    assert ctl.short == ctl.long == pytest.approx(0.75)


def test_training_result_deploys_only_improvements_and_stops_collection_otherwise():
    ctl = CollectionControl(CollectConfig(start_collecting=True, min_gain=0.01))
    assert ctl.training_result(0.5, 0.6) and ctl.collecting and ctl.deployed == 1
    assert not ctl.training_result(0.6, 0.605) and not ctl.collecting  # within min_gain: not an improvement
    assert ctl.switched_off == 1 and ctl.rejected == 1


def test_collect_config_is_validated():
    with pytest.raises(InvalidArgument, match="short_decay"):
        CollectConfig(short_decay=0.99, long_decay=0.9)
    with pytest.raises(InvalidArgument, match="margin"):
        CollectConfig(margin=1.5)
    with pytest.raises(InvalidArgument, match="rank"):
        TrainConfig(rank=0)


# ---- the buffer ----------------------------------------------------------------------------------


def test_buffer_measures_acceptance_from_the_next_delta():
    b = TrainingBuffer()
    assert b.observe("s", 0, [1, 2, 3], [7, 8, 9], True) is None  # first sight: nothing to compare
    # The target verified 7, 8 and then its own 5: two of three drafts accepted.
    assert b.observe("s", 3, [7, 8, 5], [4, 4], True) == (2, 3)
    assert b.observe("s", 6, [4, 6], [], True) == (1, 2)
    assert b.observe("s", 8, [3], [1], True) is None  # no drafts were proposed last round
    b.release(["s"])
    (done,) = b.finished
    assert list(done.tokens) == [1, 2, 3, 7, 8, 5, 4, 6, 3] and done.prompt_len == 3


def test_buffer_keeps_only_sequences_seen_while_collecting_and_complete():
    b = TrainingBuffer()
    b.observe("off", 0, [1, 2], [3], False)
    b.observe("off", 2, [3], [4], False)
    b.observe("gap", 0, [1, 2], [3], True)
    b.observe("gap", 5, [9], [4], True)  # a delta past what is known: the copy has a hole
    b.observe("on", 0, [1, 2], [3], False)
    b.observe("on", 2, [3, 4], [5], True)  # collection turned on mid-sequence: its prefix was kept anyway
    b.release(["off", "gap", "on", "never-seen"])
    assert [list(f.tokens) for f in b.finished] == [[1, 2, 3, 4]]


def test_buffer_is_bounded_in_sequences_tokens_and_live_entries():
    cfg = BufferConfig(max_live=3, max_sequence_tokens=5, max_sequences=4, max_tokens=12)
    b = TrainingBuffer(cfg)
    for k in range(10):
        b.observe(k, 0, [0, 1, 2], [1], True)
        b.observe(k, 3, [3, 4, 5, 6, 7], [], True)  # 8 tokens, 5 kept
        assert b.live <= 3
    b.release(range(10))
    assert [len(f.tokens) for f in b.finished] == [5, 5]  # 3 live were left; 12 tokens hold two of them
    assert b.tokens == 10 and len(b.finished) <= 4
    new, seen = b.take_new(0)
    assert len(new) == 2 and seen == 3  # three were added, the oldest already dropped


def test_buffer_forgets_an_owner():
    b = TrainingBuffer()
    b.observe((b"a", 1), 0, [1, 2], [3], True)
    b.observe((b"b", 1), 0, [1, 2], [3], True)
    b.forget_owner(b"a")
    assert b.live == 1


# ---- the trainer ---------------------------------------------------------------------------------


def test_low_rank_logits_start_at_zero():
    ad = LowRankLogits(16, 50, 4, torch.Generator().manual_seed(0))
    h = torch.randn(3, 16)
    assert torch.count_nonzero(ad(h)) == 0
    with torch.no_grad():
        ad.b.normal_()
    assert torch.count_nonzero(ad(h)) > 0


def test_trainer_learns_a_biased_target_and_each_micro_step_is_short(models):
    """Sequences whose continuation is always one token: a cycle must learn it, in bounded micro-steps."""
    from draft_server.tide.buffer import Finished

    draft = models["draft"]
    cfg = TrainConfig(min_new_positions=64, steps_per_cycle=40, eval_every=3, chunk_tokens=8, lr=0.05)
    tr = AdapterTrainer(draft, cfg)
    gen = torch.Generator().manual_seed(1)
    seqs = [Finished(tuple(torch.randint(5, 300, (12,), generator=gen).tolist()) + (42,) * 30, 12)
            for _ in range(9)]
    tr.add(seqs)
    result, longest = None, 0.0
    for _ in range(2000):
        t0 = time.perf_counter()
        result = tr.step()
        longest = max(longest, time.perf_counter() - t0)
        if result is not None:
            break
    assert result is not None, "no training cycle ended"
    serving, adapted = result
    assert adapted > serving and adapted > 0.9
    assert longest < 0.5  # a micro-step, not a whole cycle (generous: a shared 2-core machine)
    frozen = tr.finish(deploy=True)
    assert frozen is not None and not any(p.requires_grad for p in frozen.parameters())
    assert tr.candidate is None


# ---- metrics -------------------------------------------------------------------------------------


def test_tide_metrics_are_exported_and_pass_promtool(models):
    import shutil
    import subprocess

    from prometheus_client import generate_latest

    from draft_server.config import DraftServerConfig
    from draft_server.server import DraftServer
    from draft_server.tide.config import TideConfig

    server = DraftServer(models["draft"], DraftServerConfig(tide=TideConfig()))
    server.tide.observe_round([DraftRequest(("t", 1), 0, [1, 2, 3], 2)], [[4, 5]])
    server.tide.observe_round([DraftRequest(("t", 1), 3, [4, 9], 1)], [[6]])  # one of two drafts accepted
    text = generate_latest(server.metrics.registry).decode()
    for name in ("tide_acceptance_short_ratio", "tide_collecting", "tide_train_steps_total", "tide_swaps_total",
                 "tide_train_time_seconds_total", "tide_train_time_share_ratio", "tide_buffered_sequences"):
        assert f"starjar_draft_{name}" in text, name
    assert server.tide.proposed == 2 and server.tide.accepted == 1
    plain = DraftServer(models["draft"], DraftServerConfig())
    assert "tide" not in generate_latest(plain.metrics.registry).decode()  # off: nothing exported
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_serve_draft_adapt_flags_build_the_config():
    from controller.cli.main import _parser
    from controller.cli.serve import _draft_config

    off = _draft_config(_parser().parse_args(["serve", "draft"]))
    assert off.tide is None  # off by default
    on = _draft_config(_parser().parse_args(["serve", "draft", "--adapt"]))
    assert on.tide is not None and not on.tide.collect.start_collecting  # TIDE's default: wait for a drift
    cold = _draft_config(_parser().parse_args(["serve", "draft", "--adapt", "--adapt-collect-from-start"]))
    assert cold.tide.collect.start_collecting
    tuned = _draft_config(_parser().parse_args(["serve", "draft", "--adapt", "--adapt-train", "rank=64,lr=0.003"]))
    assert tuned.tide.train.rank == 64 and tuned.tide.train.lr == 0.003 and tuned.tide.train.eval_every == 4
    for bad in ("rank=0", "nope=1", "lr=fast", "rank"):
        with pytest.raises(InvalidArgument):
            train_config_from(bad)


def _agreement(draft, seqs, adapter=None) -> float:
    """Next-token agreement with the target over the generated part of (prompt, output) sequences."""
    right = total = 0
    for prompt, out in seqs:
        tokens = list(prompt) + list(out)
        cache = draft.new_cache()
        h = draft.hidden_states(cache, [cache.allocate()], [tokens[:-1]])[0, len(prompt) - 1:]
        logits = draft.head_logits(h, adapted=False)
        if adapter is not None:
            logits = logits + adapter(h.float())
        right += int((logits.argmax(-1) == torch.tensor(tokens[len(prompt):])).sum())
        total += len(out)
    return right / total


def test_training_on_the_targets_outputs_does_not_lower_held_out_agreement(models, prompt_ids, reference):
    """The adapter is trained on the logits serving uses (the whole vocabulary): trained on the target's own
    greedy outputs, it must not make a good draft worse on sequences it never saw. (The first trainer's
    softmax over the base's top-k + the truth raised tokens wherever they were not candidates: one cycle
    took a real int8 draft 0.97 -> 0.49, and this tiny one down as well.)"""
    from draft_server.tide.buffer import Finished

    draft = models["draft"]
    seqs = [(p, o) for p, o in zip(prompt_ids, reference("llama", 48), strict=True) if len(o) > 1]
    train, unseen = [s for i, s in enumerate(seqs) if i % 3], seqs[::3]
    tr = AdapterTrainer(draft, TrainConfig(min_new_positions=256, steps_per_cycle=96))
    tr.add([Finished(tuple(p) + tuple(o), len(p)) for p, o in train])
    result = None
    for _ in range(5000):
        if (result := tr.step()) is not None:
            break
    assert result is not None, "no training cycle ended"
    adapter = tr.finish(deploy=True)  # deployed whatever held-out says: the training itself must not harm
    before, after = _agreement(draft, unseen), _agreement(draft, unseen, adapter)
    assert before > 0.3  # a draft with something to lose
    assert after >= before - 0.02, (before, after)


def _run_cycles(tr: AdapterTrainer, draft, limit: int = 5000) -> list[tuple[float, float]]:
    """Step until the trainer has nothing left to do; each cycle's adapter is deployed when it beats serving
    (the gate of draft_server.tide.adaptation). Returns each cycle's (serving, candidate) held-out agreement."""
    results = []
    for _ in range(limit):
        if not tr.has_work():
            break
        if (result := tr.step()) is not None:
            results.append(result)
            adapter = tr.finish(deploy=result[1] > result[0])
            if adapter is not None:
                draft.adapter = adapter
    return results


def _switch_domains(draft, eval_recent: int) -> tuple[float, float]:
    """9 finished sequences of an old domain (continuation: 42 43 42 43 ...), its cycles deployed; then 6 of
    a new one (42 44 42 44 ...: after 42 comes 44, no longer 43), fewer held-out sequences than the old
    domain's. Returns the first cycle after the switch: (serving, candidate) held-out agreement."""
    from draft_server.tide.buffer import Finished

    gen = torch.Generator().manual_seed(3)

    def domain(second: int, n: int) -> list[Finished]:
        return [Finished(tuple(torch.randint(5, 300, (8,), generator=gen).tolist()) + (42, second) * 10, 8)
                for _ in range(n)]

    cfg = TrainConfig(min_new_positions=60, steps_per_cycle=30, eval_every=3, chunk_tokens=16, lr=0.05,
                      max_positions=40, eval_recent=eval_recent)
    tr = AdapterTrainer(draft, cfg)
    tr.add(domain(43, 9))  # the old domain: 3 held-out sequences
    old = _run_cycles(tr, draft)
    assert old and old[0][1] > old[0][0] and draft.adapter is not None  # learned the old domain
    tr.add(domain(44, 6))  # the switch: 2 held-out sequences
    new = _run_cycles(tr, draft)
    assert new, "no cycle after the switch"
    return new[0]


def test_held_out_judges_an_adapter_on_the_newest_traffic(models):
    """Right after a domain switch a cycle must be scored on the new domain's held-out sequences, not on the
    older ones: the adapter trained on the new domain wins and is deployed. Scored on the whole held-out ring
    (the old behaviour, eval_recent past the ring), the old domain's majority kept the old adapter."""
    draft = models["draft"]
    try:
        serving, candidate = _switch_domains(draft, eval_recent=16)
        assert candidate > serving + 0.5, (serving, candidate)
        draft.adapter = None
        serving, candidate = _switch_domains(draft, eval_recent=1 << 20)
        assert candidate <= serving, (serving, candidate)  # the whole ring: the old domain outvotes the new
    finally:
        draft.adapter = None


def test_tide_oracle_speedup_model():
    """bench tide-oracle's model: (1 - a^(g+1)) / (1 - a) tokens over g c + V(g+1) target steps, gamma 0 = 1."""
    from benchmarks.tide_oracle import agreement_for, best_gamma, speedup

    flat = [1.0, 1.0, 1.0, 1.0]  # verification as cheap as one step
    assert speedup(0.5, 0, 0.3, flat) == 1.0
    assert speedup(0.5, 2, 0.25, flat) == pytest.approx(1.75 / 1.5)
    assert best_gamma(0.0, 0.3, flat) == (0, 1.0)  # a draft that is never right: do not speculate
    steep = [1.0, 1.7, 1.9, 1.7]  # this CPU's shape: two tokens cost 1.7 steps
    assert best_gamma(0.3, 0.28, steep)[0] == 0
    need = agreement_for(1.05, 0.28, steep)
    assert best_gamma(need, 0.28, steep)[1] >= 1.05 > best_gamma(need - 0.001, 0.28, steep)[1]
    assert agreement_for(10.0, 0.28, steep) is None
