"""Co-located mode: the target engine and the draft engine in one process.

This is the baseline the distributed mode is measured against, and what
`starjar generate` runs when it is given a local draft directory.
"""

from __future__ import annotations

from draft_server.engine import DraftEngine
from starjar.model.loading import LoadedModel, check_pair, load_model
from starjar.model.prompt_kv import prompt_kv_shared, seeder
from starjar.spec.policy import FixedGamma, SpeculationPolicy
from target_worker.config import engine_config
from target_worker.engine import TargetEngine


def load_pair(target_dir: str, draft_dir: str | None, device: str = "cpu",
              dtype: str = "float32") -> tuple[LoadedModel, LoadedModel | None]:
    target = load_model(target_dir, device, dtype, what="target")
    draft = load_model(draft_dir, device, dtype, what="draft") if draft_dir else None
    if draft is not None:
        check_pair(target, draft)
    return target, draft


def colocated_engine(target: LoadedModel, draft: LoadedModel | None, gamma: int = 0,
                     max_batch_size: int = 16, policy: SpeculationPolicy | None = None,
                     kv_budget_tokens: int | None = None) -> TargetEngine:
    """A target engine whose proposer is an in-process draft engine (none when gamma is 0)."""
    if policy is None:
        policy = FixedGamma(gamma if draft is not None else 0)
    cfg = engine_config(max_batch_size, gamma, kv_budget_tokens)
    proposer = DraftEngine(draft, max_sequences=max_batch_size * 4) if draft is not None else None
    engine = TargetEngine(target, proposer, policy, cfg)
    if draft is not None and prompt_kv_shared(target, draft):
        engine.seed_draft = seeder(draft, proposer.seed)  # each prompt's KV from the target's prefill
    return engine


def remote_engine(target: LoadedModel, draft_address: str, gamma: int, max_batch_size: int = 16,
                  wait_attach_s: float = 10.0, deadline_s: float = 0.5,
                  policy: SpeculationPolicy | None = None) -> TargetEngine:
    """A target engine whose proposer is a remote draft server (the distributed mode, one process);
    policy: default gamma on every step."""
    import os

    from target_worker.remote.client import RemoteProposer

    proposer = RemoteProposer(draft_address, target.fingerprint, f"generate:{os.getpid()}", deadline_s)
    proposer.wait_attached(wait_attach_s)  # decoding starts anyway; it speculates once attached
    engine = TargetEngine(target, proposer, policy or FixedGamma(gamma), engine_config(max_batch_size, gamma))
    engine.send_ahead = proposer.send_ahead
    proposer.hand_prompt_kv(target)
    engine.seed_draft = proposer.seed  # each prompt with its KV, where the server's draft is the target's copy
    return engine
