"""A target moved from one draft server to another mid-generation (RemoteProposer.follow, what the
controller calls on a rebalance or a retirement): same output, speculation resumes on the new server, the old
one frees the target's session."""

from __future__ import annotations

import threading
import time

from draft_server.background import BackgroundDraftServer
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer


def test_follow_moves_a_target_mid_run_without_changing_its_output(models, prompt_ids, reference):
    with BackgroundDraftServer(models["draft"]) as a, BackgroundDraftServer(models["draft"]) as b:
        where = {"address": a.address}
        rp = RemoteProposer(lambda: where["address"], models["llama"].fingerprint, "mover", deadline_s=2.0,
                            backoff_s=(0.02, 0.2))
        assert rp.wait_attached(10) and rp.address == a.address
        engine = TargetEngine(models["llama"], rp, FixedGamma(3), EngineConfig(max_batch_size=4))
        outs = {}
        run = threading.Thread(target=lambda: outs.setdefault(
            "ids", [r.output_ids for r in engine.generate(prompt_ids[:16], SamplingParams(max_tokens=48))]))
        run.start()
        deadline = time.time() + 30
        while a.server.stats.snapshot()["rounds"] < 3 and time.time() < deadline:
            time.sleep(0.01)
        t_move = time.time()
        where["address"] = b.address
        rp.follow()
        assert rp.wait_attached(10) and rp.address == b.address and rp.attached_at >= t_move
        run.join(120)
        assert outs["ids"] == reference("llama", 48)[:16]
        assert a.server.stats.snapshot()["rounds"] >= 3 and b.server.stats.snapshot()["rounds"] > 0
        deadline = time.time() + 5
        while len(a.server.sessions) and time.time() < deadline:
            time.sleep(0.05)
        assert len(a.server.sessions) == 0  # the old server let the moved target go
        rp.close()
