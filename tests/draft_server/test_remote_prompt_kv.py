"""A draft server whose draft is an int8 copy of the target's weights takes each prompt with the KV the target's
prefill wrote (SequenceRound.prompt_kv) instead of prefilling it; whatever it is sent, the output stays the
target's own."""

from __future__ import annotations

import shutil

import grpc
import pytest
import torch
from draft_stream import Stream, attach, served
from int8_drafts import int8_draft_dir, prefilled
from prometheus_client import generate_latest

from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from draft_server.engine import DraftEngine
from starjar.model.loading import load_model
from starjar.model.prompt_kv import from_wire, to_wire, weights_id, wire_bytes
from starjar.spec.policy import FixedGamma
from starjar.spec.proposer import DraftRequest
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer
from target_worker.remote.prompt_rounds import KV_MESSAGE_SLACK


@pytest.fixture(scope="module")
def smoothed(tmp_path_factory, model_dirs):
    return load_model(int8_draft_dir(tmp_path_factory.mktemp("remote-seed"), model_dirs["llama"], smooth_alpha=0.5))


def _prefilled_kv(model, ids):
    cache, slot = prefilled(model, ids)
    return cache.prefix(slot, len(ids))


def test_weights_are_named_by_their_files_not_their_place(model_dirs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(model_dirs["llama"], copy)
    assert weights_id(copy) == weights_id(model_dirs["llama"]) != ""
    assert weights_id(model_dirs["qwen2"]) != weights_id(model_dirs["llama"])
    assert weights_id(tmp_path) == ""  # no safetensors: nothing to name


def test_the_wire_form_reads_back_in_the_drafts_terms(models, smoothed, prompt_ids):
    ids = prompt_ids[0][:9]
    layers = _prefilled_kv(models["llama"], ids)
    data = to_wire(layers, 2, 7)
    assert len(data) == wire_bytes(smoothed, 5)
    back = from_wire(data, smoothed, 5)
    for (k, v), (k2, v2), s in zip(layers, back, smoothed.value_scales, strict=True):
        torch.testing.assert_close(k2, k[:, 2:7], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(v2, v[:, 2:7] / s[:, None, :], atol=2e-3, rtol=2e-3)  # smoothed as its own
    assert from_wire(data, smoothed, 4) is None  # the size must be the tokens'
    bad = bytearray(data)
    bad[0:2] = torch.tensor([float("inf")], dtype=torch.float16).numpy().tobytes()
    assert from_wire(bytes(bad), smoothed, 5) is None


def test_a_remote_copy_takes_each_prompt_with_its_kv_and_the_output_stays_the_targets(
        models, smoothed, prompt_ids, reference):
    prompts = prompt_ids[:6]
    per_token = wire_bytes(models["llama"], 1)
    runs = {}
    with BackgroundDraftServer(smoothed) as srv:
        engine = srv.server.compute.engine
        for seeded in (True, False):
            # A message limit of 5 tokens' KV: every prompt goes over several rounds.
            rp = RemoteProposer(srv.address, models["llama"].fingerprint, f"t-{seeded}", deadline_s=5.0,
                                max_message_bytes=KV_MESSAGE_SLACK + 5 * per_token)
            try:
                assert rp.wait_attached(10)
                assert rp.limits.prompt_kv_from == weights_id(models["llama"].path)
                eng = TargetEngine(models["llama"], rp, FixedGamma(3), EngineConfig(max_batch_size=2))
                if seeded:
                    rp.hand_prompt_kv(models["llama"])
                    eng.seed_draft = rp.seed
                before = (engine.stats.seeded_tokens, engine.stats.catchup_tokens)
                outs = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=24))]
                assert outs == reference("llama", 24)[:6]
                runs[seeded] = (rp.stats.seeded_tokens, engine.stats.seeded_tokens - before[0],
                                engine.stats.catchup_tokens - before[1], eng.stats.acceptance_rate)
            finally:
                rp.close()
        scraped = generate_latest(srv.server.metrics.registry).decode()
    (sent, took, catchup, acc), (sent0, took0, catchup0, acc0) = runs[True], runs[False]
    prompt_tokens = sum(map(len, prompts))
    assert sent == took == prompt_tokens and sent0 == took0 == 0
    assert f"starjar_draft_prompt_kv_tokens_total {float(prompt_tokens)}" in scraped
    assert catchup < catchup0 - prompt_tokens // 2  # the server fed far less itself
    assert acc > acc0 - 0.1, (acc, acc0)


def test_prompt_kv_that_does_not_fit_is_answered_resync_and_the_stream_goes_on(models, smoothed, prompt_ids):
    ids = [int(t) for t in prompt_ids[1][:8]]
    kv = _prefilled_kv(models["llama"], ids)
    with served(models, smoothed, [DraftServerConfig()]) as (_, (stream,), (stub,)):
        assert attach(stub, models, "other").limits.prompt_kv_from == weights_id(models["llama"].path)
        good = to_wire(kv, 0, 5)
        for seq, bad in [
            (dict(seq_id=1, start=0, tokens=ids[:5], gamma=0, prompt_kv=good[:-2]), "short"),
            (dict(seq_id=2, start=0, tokens=ids[:5], gamma=2, prompt_kv=good), "asks drafts"),
            (dict(seq_id=3, start=0, tokens=ids[:4], gamma=0, prompt_kv=good), "another length"),
        ]:
            assert stream.round(seq).sequences[0].resync, bad
        inf = bytearray(good)
        inf[0:2] = torch.tensor([float("nan")], dtype=torch.float16).numpy().tobytes()
        assert stream.round(dict(seq_id=4, start=0, tokens=ids[:5], gamma=0, prompt_kv=bytes(inf))).sequences[0].resync
        # Taken in two parts; a part past a gap is refused and drops the sequence (its next round resyncs).
        assert not stream.round(dict(seq_id=5, start=0, tokens=ids[:5], gamma=0, prompt_kv=good)).sequences[0].resync
        assert stream.round(dict(seq_id=5, start=6, tokens=ids[6:8], gamma=0,
                                 prompt_kv=to_wire(kv, 6, 8))).sequences[0].resync
        assert stream.round(dict(seq_id=5, start=5, tokens=ids[5:], gamma=1)).sequences[0].resync
        assert not stream.round(dict(seq_id=6, start=0, tokens=ids[:5], gamma=0, prompt_kv=good)).sequences[0].resync
        assert not stream.round(dict(seq_id=6, start=5, tokens=ids[5:7], gamma=0,
                                     prompt_kv=to_wire(kv, 5, 7))).sequences[0].resync
        drafts = stream.round(dict(seq_id=6, start=7, tokens=ids[7:], gamma=3)).sequences[0]
        assert not drafts.resync and len(drafts.tokens) == 3


def test_a_server_that_prefills_itself_advertises_nothing_and_refuses_prompt_kv(models, prompt_ids):
    ids = [int(t) for t in prompt_ids[1][:5]]
    kv = to_wire(_prefilled_kv(models["llama"], ids), 0, 5)
    with BackgroundDraftServer(models["draft"]) as srv, grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.DraftServiceStub(ch)
        reply = attach(stub, models)
        assert reply.limits.prompt_kv_from == ""
        stream = Stream(stub, reply.tag)
        try:
            assert stream.round(dict(seq_id=1, start=0, tokens=ids, gamma=0, prompt_kv=kv)).sequences[0].resync
            assert not stream.round(dict(seq_id=2, start=0, tokens=ids, gamma=2)).sequences[0].resync
        finally:
            stream.close()


def test_a_prompt_handed_to_an_offloaded_draft_is_refused_and_leaves_it_offloaded(models, smoothed, prompt_ids):
    ids = [int(t) for t in prompt_ids[2][:6]]
    kv = to_wire(_prefilled_kv(models["llama"], ids), 0, 6)
    engine = DraftEngine(smoothed)
    engine.offload()
    replies, jobs = engine.start([DraftRequest("s", 0, ids, 0, 0, kv)])
    assert replies == [None] and not jobs
    assert engine.offloaded and engine._reloader is None  # nothing asked for the weights back
    replies, _ = engine.start([DraftRequest("s", 0, ids, 2)])  # a round that wants drafts does
    assert replies == [None] and engine.wait_reloaded(10)
    replies, _ = engine.start([DraftRequest("t", 0, ids, 0, 0, kv)])
    assert replies == [[]] and engine.stats.seeded_tokens == 6
