"""Online draft adaptation (TIDE) on a real draft server over loopback gRPC: the draft learns, the outputs
never change, a swap mid-stream is harmless, an opted-out target is never recorded, and no prompt text
reaches a log or a file."""

from __future__ import annotations

import os
import threading
import time
import uuid

import grpc
import pytest
import torch

from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from draft_server.tide.collect import CollectConfig
from draft_server.tide.config import TideConfig, TrainConfig
from draft_server.tide.trainer import LowRankLogits
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer
from target_worker.tree_score import TreeConfig

MAX_NEW = 48  # the session's reference() length: its outputs are shared with the other suites
# Collect from the first round and train after a few sequences: the tiny runs are short.
FAST = TideConfig(collect=CollectConfig(start_collecting=True), train=TrainConfig(min_new_positions=64))


@pytest.fixture(scope="module")
def far_draft(model_dirs):
    """A draft that shares the llama target's tokenizer but not its weights: plenty left to learn."""
    from benchmarks.fixtures.tiny_models import make_tiny_model
    from starjar.model.loading import load_model

    root = os.path.join(os.path.dirname(model_dirs["llama"]), "far_draft")
    return load_model(make_tiny_model(root, "llama", seed=5, layers=1, tokenizer_from=model_dirs["llama"]))


@pytest.fixture(scope="module")
def alone(prompt_ids, reference):
    """The target decoding alone (HF generate, greedy) on the prompts these tests use."""
    return prompt_ids[:12], reference("llama", MAX_NEW)[:12]


@pytest.fixture(scope="module")
def to_learn(prompt_ids, reference):
    """Twelve prompts on which the far draft is weak, so that a few short cycles have something to learn: on
    prompt_ids[:12] it already agrees 0.59 with the target on held-out positions, and no candidate beat it."""
    return prompt_ids[24:36], reference("llama", MAX_NEW)[24:36]


def _engine(models, address, worker, no_training=False):
    rp = RemoteProposer(address, models["llama"].fingerprint, worker, 5.0, backoff_s=(0.02, 0.2),
                        no_training=no_training)
    assert rp.wait_attached(10)
    return TargetEngine(models["llama"], rp, FixedGamma(3), EngineConfig(max_batch_size=4)), rp


def _generate(eng, prompts, max_new=MAX_NEW):
    return [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=max_new))]


def _wait(cond, timeout=60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_the_draft_learns_and_outputs_stay_the_targets(models, far_draft, to_learn):
    prompts, ref = to_learn
    with BackgroundDraftServer(far_draft, DraftServerConfig(tide=FAST)) as srv:
        tide = srv.server.tide
        eng, rp = _engine(models, srv.address, "learner")
        assert _generate(eng, prompts) == ref
        before = eng.stats.accepted_tokens / eng.stats.drafted_tokens
        rp.close()
        assert _wait(lambda: tide.swaps >= 1), f"no adapted draft was swapped in: {tide.snapshot()}"
        eng, rp = _engine(models, srv.address, "learner-again")
        assert _generate(eng, prompts) == ref
        after = eng.stats.accepted_tokens / eng.stats.drafted_tokens
        rp.close()
        with grpc.insecure_channel(srv.address) as ch:
            stats = pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)
    assert after > before, (before, after)
    assert tide.trainer.positions_captured > 0 and tide.trainer.positions_rerun == 0  # no pass of its own
    assert stats.tide_swaps >= 1 and stats.tide_train_steps > 0 and stats.tide_train_s > 0
    assert 0 < stats.tide_heldout_acceptance <= 1 and stats.tide_buffered_sequences > 0


def test_captured_hidden_states_are_the_drafts_own_on_the_verified_tokens(models, far_draft, alone):
    """What the serving passes left in the buffer (drafts rejected, positions re-fed, batched with other
    sequences) equals a fresh pass of the draft over the verified tokens: the training signal is right."""
    prompts, ref = alone
    cfg = TideConfig(collect=CollectConfig(start_collecting=True), train=TrainConfig(min_new_positions=1 << 20))
    with BackgroundDraftServer(far_draft, DraftServerConfig(tide=cfg)) as srv:
        tide = srv.server.tide
        tide.wants_idle = lambda: False  # keep every finished sequence in the buffer, untouched
        eng, rp = _engine(models, srv.address, "capture")
        assert _generate(eng, prompts[:6]) == ref[:6]
        rp.close()
        assert _wait(lambda: len(tide.buffer.finished) == 6, 10)
        finished = list(tide.buffer.finished)
    assert far_draft.hidden_tap is None  # the stopped server no longer taps the model
    checked = 0
    for seq in finished:
        cache = far_draft.new_cache()
        fresh = far_draft.hidden_states(cache, [cache.allocate()], [list(seq.tokens)])[0]
        assert seq.hidden and max(seq.hidden) == len(seq.tokens) - 2 and min(seq.hidden) >= seq.prompt_len - 1
        for pos, row in seq.hidden.items():
            assert torch.allclose(row, fresh[pos], atol=1e-4), pos
            checked += 1
    assert checked > 100


def test_a_swap_mid_stream_keeps_outputs_identical(models, far_draft, alone, long_prompts):
    """An adapter that wrecks the proposals is swapped in while long sequences are being drafted: their
    drafts change from the next pass on, their KV stays, and every output is still the target's."""
    prompts, refs = long_prompts
    cfg = TideConfig(collect=CollectConfig(start_collecting=False))
    with BackgroundDraftServer(models["draft"], DraftServerConfig(tide=cfg)) as srv:
        eng, rp = _engine(models, srv.address, "mid-stream")
        out: list = []
        runner = threading.Thread(target=lambda: out.extend(_generate(eng, prompts, 300)))
        runner.start()
        assert _wait(lambda: eng.stats.drafted_tokens > 100)
        good = eng.stats.accepted_tokens / eng.stats.drafted_tokens
        bad = LowRankLogits(models["draft"].model.config.hidden_size, models["draft"].vocab_size, 2)
        with torch.no_grad():
            bad.bias[7] = 1e4  # always propose token 7
        srv.server.tide.offer(bad)
        drafted, accepted = eng.stats.drafted_tokens, eng.stats.accepted_tokens
        runner.join(timeout=300)
        rp.close()
        assert srv.server.tide.swaps == 1 and srv.server.compute.engine.model.adapter is bad
    assert out == refs
    late = (eng.stats.accepted_tokens - accepted) / max(1, eng.stats.drafted_tokens - drafted)
    assert eng.stats.drafted_tokens - drafted > 50 and late < good / 2, (good, late)
    models["draft"].adapter = None  # the session-scoped draft goes back as it was


def test_an_opted_out_target_is_never_recorded(models, far_draft, alone):
    prompts, ref = alone
    with BackgroundDraftServer(far_draft, DraftServerConfig(tide=FAST)) as srv:
        tide = srv.server.tide
        quiet, rp_quiet = _engine(models, srv.address, "quiet", no_training=True)
        assert _generate(quiet, prompts[:4]) == ref[:4]
        rp_quiet.close()
        time.sleep(0.3)
        assert tide.buffer.added == 0 and tide.buffer.live == 0 and tide.proposed == 0
        loud, rp_loud = _engine(models, srv.address, "loud")
        assert _generate(loud, prompts[:4]) == ref[:4]
        rp_loud.close()
        assert _wait(lambda: tide.buffer.added == 4, 10)
    far_draft.adapter = None


@pytest.mark.slow
def test_no_prompt_text_on_disk_or_in_logs_with_adaptation_on(model_dirs, tmp_path):
    """The prompt-marker test of test_no_prompt_in_logs, with the draft server adapting (debug logging)."""
    from prompt_marker import files_with_marker, sdk_traffic

    from benchmarks.launch import ServerProcess

    marker = f"mk{uuid.uuid4().hex}"
    home, logs = tmp_path / "starjar_home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    env = dict(os.environ, STARJAR_HOME=str(home))
    verbose = "controller.cli.main -v serve"
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0", "--adapt",
                          "--adapt-collect-from-start", module=verbose, log_path=logs / "draft.log", env=env)
    target = ServerProcess("target", "--model", model_dirs["llama"], "--draft-server", draft.address, "--port", "0",
                           "--gamma", "3", "--worker-id", "marker", module=verbose, log_path=logs / "target.log",
                           env=env)
    try:
        sdk_traffic(target.address, marker)
        with grpc.insecure_channel(draft.address) as ch:
            stats = pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)
        assert target.terminate() == 0 and draft.terminate() == 0
        stdout = target.proc.stdout.read() + draft.proc.stdout.read()
    finally:
        target.kill()
        draft.kill()
    assert stats.tide_buffered_sequences > 0, "nothing was buffered: the test would prove nothing"
    assert (logs / "draft.log").stat().st_size > 0
    assert marker not in stdout
    assert files_with_marker(marker, logs, home) == []


def test_a_round_preempts_training_within_one_micro_step(models, alone):
    """Training never holds a round back for longer than the micro-step in progress: here each micro-step
    is a 0.3 s pause (a slowed trainer), and the loop has one to run whenever no round is in flight."""
    prompts, ref = alone
    with BackgroundDraftServer(models["draft"], DraftServerConfig(tide=TideConfig())) as srv:
        tide = srv.server.tide
        pauses = []

        def slow_step() -> float:
            time.sleep(0.3)
            pauses.append(1)
            return 0.3

        tide.wants_idle, tide.idle_step = (lambda: True), slow_step
        eng, rp = _engine(models, srv.address, "preempt")
        assert _generate(eng, prompts[:4], 16) == [r[:16] for r in ref[:4]]
        waits = list(rp.stats.server_queue_s)
        rp.close()
    assert len(pauses) > 5 and len(waits) >= 5
    assert max(waits) < 0.3 + 0.25, max(waits)  # at most the one micro-step in progress (and some scheduling)


def test_token_trees_beside_adaptation_keep_their_replies_and_the_adaptation(models, far_draft, alone, caplog):
    """A target drafting token trees on an adapting server: every round is answered with its tree (before, the
    adaptation's observer raised on a tree reply, and the rounds after it in that pass were never answered),
    outputs stay the target's, and the adaptation is still on afterwards."""
    prompts, ref = alone
    with BackgroundDraftServer(far_draft, DraftServerConfig(tide=FAST)) as srv:
        rp = RemoteProposer(srv.address, models["llama"].fingerprint, "trees", 5.0, backoff_s=(0.02, 0.2))
        assert rp.wait_attached(10)
        cfg = EngineConfig(max_batch_size=4, max_gamma=4, tree=TreeConfig("adaserve", width=3, budget=32, cap=8))
        eng = TargetEngine(models["llama"], rp, FixedGamma(3), cfg)
        assert _generate(eng, prompts[:6]) == ref[:6]
        rp.close()
        assert srv.server.tide is not None and srv.server.compute.tide is not None
    assert eng.stats.tree_rounds > 0  # trees were drafted and verified
    assert eng.stats.proposer_failures == 0 and sum(rp.stats.fallbacks.values()) == 0, rp.stats.fallbacks
    # A failed pass answers every round in flight with resync and drops the draft's KV: none may happen.
    assert eng.stats.resyncs == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
